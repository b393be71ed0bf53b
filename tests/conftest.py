import sys
from pathlib import Path

# tests/ holds helper modules (naive_k3) imported by the tests.
sys.path.insert(0, str(Path(__file__).parent))
