"""One rank of the Slurm tests: report where hora placed it, then train train_digits.py (with checkpoints).

    srun python slurm_train.py OUTDIR [train_digits.py arguments | --init-only]
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import train_digits  # noqa: E402

import hora  # noqa: E402

hora.init()
record = {"rank": hora.rank(), "size": hora.size(), "local_rank": hora.local_rank(),
          "local_size": hora.local_size(), "cross_rank": hora.cross_rank(), "cross_size": hora.cross_size(),
          "host": socket.gethostname(),
          # the job's secret, made by hora.sbatch: whether hora authenticates with it, and which one (a digest)
          "authenticated": hora.runtime.lifecycle.state().job_store.authenticated,
          "secret": hashlib.sha256(os.environ.get("HORA_SECRET", "").encode()).hexdigest()[:16]}
if sys.argv[2:] != ["--init-only"]:
    record.update(train_digits.main(sys.argv[2:]))
Path(sys.argv[1], f"rank-{hora.rank()}.json").write_text(json.dumps(record))
