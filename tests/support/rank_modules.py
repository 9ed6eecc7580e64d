"""Run src/train_deepspeed.py as one training rank would (RANK, WORLD_SIZE, MASTER_* as torchrun sets them)
and write the names in sys.modules at exit to OUT:

    python tests/support/rank_modules.py OUT.json [TRAINING FLAGS...]
"""

import atexit
import json
import os
import runpy
import socket
import sys
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[2] / "src" / "train_deepspeed.py"

out, *argv = sys.argv[1:]
with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
os.environ.update(
    RANK="0",
    LOCAL_RANK="0",
    WORLD_SIZE="1",
    LOCAL_WORLD_SIZE="1",
    MASTER_ADDR="127.0.0.1",
    MASTER_PORT=str(port),
)
atexit.register(lambda: Path(out).write_text(json.dumps(sorted(sys.modules))))
sys.argv = [str(TRAIN), *argv]
runpy.run_path(str(TRAIN), run_name="__main__")
