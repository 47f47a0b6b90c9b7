"""nanoGPT's ``train.py`` made ready to run on CPU in a directory of its own: its files (``train.py`` with the
three lines of ``CPU_PATCH``), a tiny data set, and its command line under ``torchrun --nproc-per-node 2``
(``tests/test_capture_job.py``, ``benchmarks/captured_job_overhead.py``)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

HERE = Path(__file__).parent

# nanoGPT's DDP branch assumes CUDA; these three lines take the CPU instead (see README.md).
CPU_PATCH = [
    (
        "    device = f'cuda:{ddp_local_rank}'\n",
        "    device = f'cuda:{ddp_local_rank}' if torch.cuda.is_available() else 'cpu'\n",
    ),
    ("    torch.cuda.set_device(device)\n", "    torch.cuda.set_device(device) if device != 'cpu' else None\n"),
    (
        "    model = DDP(model, device_ids=[ddp_local_rank])\n",
        "    model = DDP(model, device_ids=[ddp_local_rank] if device_type == 'cuda' else None)\n",
    ),
]


def nanogpt_job(where: Path, *, max_iters: int = 2, nproc: int = 2, backend: str = "gloo") -> list[str]:
    """nanoGPT's files in ``where`` (a new directory), a tiny data set, and its command line (``max_iters``
    + 1 optimizer steps) on ``nproc`` ranks; with ``backend`` nccl, nanoGPT's own CUDA path."""
    import numpy as np

    where.mkdir()
    for f in ("model.py", "configurator.py", "nanogpt_loss.py", "nanogpt-ddp.yaml"):
        shutil.copy(HERE / f, where / f)
    text = (HERE / "train.py").read_text()
    for old, new in CPU_PATCH:
        if text.count(old) != 1:
            raise AssertionError(f"nanoGPT's train.py changed: {old.strip()!r} is not there once")
        text = text.replace(old, new)
    (where / "train.py").write_text(text)
    (where / "data" / "tiny").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split in ("train", "val"):  # uint16 tokens, as nanoGPT's prepare.py scripts write them
        rng.integers(0, 50257, 4096, dtype=np.uint16).tofile(where / "data" / "tiny" / f"{split}.bin")
    sys.path.insert(0, str(HERE))
    try:
        from nanogpt_loss import CONFIG
    finally:
        sys.path.remove(str(HERE))
    tiny = {**CONFIG, "dataset": "tiny", "batch_size": 2, "gradient_accumulation_steps": 2, "max_iters": max_iters}
    tiny |= {"eval_interval": 1000, "eval_iters": 1, "compile": False, "dtype": "float32", "backend": backend}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    return [*torchrun, "train.py", *(f"--{k}={v}" for k, v in tiny.items())]
