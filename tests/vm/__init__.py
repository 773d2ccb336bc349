"""qemu guest harness for the `vm` tests (a Debian guest with emulated NVMe drives)."""
