import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
