import sys
from pathlib import Path

# tests import their sibling helpers (plan_fixtures) directly
sys.path.insert(0, str(Path(__file__).resolve().parent))
