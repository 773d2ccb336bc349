"""The rehearsal of a whole cluster: `gpuprov up` on a generated bundle against qemu stand-in nodes."""
