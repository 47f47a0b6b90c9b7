"""Write real Flight Recorder dumps from a 2-rank gloo job, with whatever torch this interpreter has.

    python make_dump.py OUTDIR [--mode normal|hang] [--port P] [--hang-after S]

OUTDIR/pickle/fr_<rank>       the pickle form (_dump_fr_trace / _dump_nccl_trace), as TORCH_FR_DUMP_TEMP_FILE names it
OUTDIR/json/fr_<rank>.json    the JSON form (_dump_fr_trace_json / _dump_nccl_trace_json), where the version has it
OUTDIR/meta.json              torch version, which dump functions exist, which ops ran, per rank

normal: every rank issues the same calls (all_reduce of a few sizes/dtypes, all_gather, broadcast,
reduce_scatter, send/recv, calls on a new subgroup), then dumps on request.
hang: as normal, then rank 0 issues one more all_reduce that rank 1 skips (rank 1 sleeps instead); a thread
in each rank dumps after --hang-after seconds while rank 0 is blocked; the parent then kills both ranks.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from datetime import timedelta

BUFFER = "2000"
# Both names: TORCH_FR_BUFFER_SIZE (newer torch), TORCH_NCCL_TRACE_BUFFER_SIZE (older torch; newer reads it too).
os.environ.setdefault("TORCH_FR_BUFFER_SIZE", BUFFER)
os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", BUFFER)


def _dumpers():
    import torch._C._distributed_c10d as c10d

    pick = next((n for n in ("_dump_fr_trace", "_dump_nccl_trace") if hasattr(c10d, n)), None)
    js = next((n for n in ("_dump_fr_trace_json", "_dump_nccl_trace_json") if hasattr(c10d, n)), None)
    return c10d, pick, js


def dump(outdir: str, rank: int, meta: dict) -> None:
    c10d, pick, js = _dumpers()
    meta["dump_functions"] = {"pickle": pick, "json": js}
    meta["all_dump_functions"] = sorted(n for n in dir(c10d) if n.startswith("_dump"))
    if pick == "_dump_fr_trace" and hasattr(c10d, "_dump_nccl_trace"):
        # a CUDA build has both: the NCCL-only recorder too, written aside (nccl-pickle/, nccl-json/)
        for fn, sub, name in (
            ("_dump_nccl_trace", "nccl-pickle", f"fr_{rank}"),
            ("_dump_nccl_trace_json", "nccl-json", f"fr_{rank}.json"),
        ):
            try:
                data = getattr(c10d, fn)()
                data = data.encode() if isinstance(data, str) else data
                os.makedirs(os.path.join(outdir, sub), exist_ok=True)
                with open(os.path.join(outdir, sub, name), "wb") as f:
                    f.write(data)
            except Exception as exc:
                meta[f"{fn}_error"] = repr(exc)
    if pick:
        os.makedirs(os.path.join(outdir, "pickle"), exist_ok=True)
        try:
            data = getattr(c10d, pick)()
            with open(os.path.join(outdir, "pickle", f"fr_{rank}"), "wb") as f:
                f.write(data)
            meta["pickle_bytes"] = len(data)
        except Exception as exc:
            meta["pickle_error"] = repr(exc)
    if js:
        os.makedirs(os.path.join(outdir, "json"), exist_ok=True)
        try:
            data = getattr(c10d, js)()
            data = data.encode() if isinstance(data, str) else data
            with open(os.path.join(outdir, "json", f"fr_{rank}.json"), "wb") as f:
                f.write(data)
            meta["json_bytes"] = len(data)
        except Exception as exc:
            meta["json_error"] = repr(exc)


def rank_main(rank: int, world: int, port: int, outdir: str, mode: str, hang_after: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    meta: dict = {
        "torch": torch.__version__,
        "rank": rank,
        "mode": mode,
        "ops": {},
        "env": {k: os.environ[k] for k in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")},
    }
    timeout = timedelta(seconds=120 if mode == "hang" else 60)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)

    def op(name, fn):
        try:
            fn()
            meta["ops"][name] = "ok"
        except Exception as exc:
            meta["ops"][name] = f"error: {exc!r}"[:300]

    op("all_reduce float32 [1024]", lambda: dist.all_reduce(torch.ones(1024)))
    op("all_reduce float32 [4,256]", lambda: dist.all_reduce(torch.ones(4, 256)))
    op("all_reduce float64 [3]", lambda: dist.all_reduce(torch.ones(3, dtype=torch.float64)))
    op("all_reduce int64 [7]", lambda: dist.all_reduce(torch.ones(7, dtype=torch.int64)))
    op("all_reduce bfloat16 [64]", lambda: dist.all_reduce(torch.ones(64, dtype=torch.bfloat16)))
    op("all_gather float32 [16] x2", lambda: dist.all_gather([torch.empty(16) for _ in range(world)], torch.ones(16)))
    op(
        "all_gather_into_tensor float32 [32]->[64]",
        lambda: dist.all_gather_into_tensor(torch.empty(32 * world), torch.ones(32)),
    )
    op("broadcast float32 [100] src 0", lambda: dist.broadcast(torch.ones(100), src=0))
    op(
        "reduce_scatter float32 2x[8]->[8]",
        lambda: dist.reduce_scatter(torch.empty(8), [torch.ones(8) for _ in range(world)]),
    )
    op(
        "reduce_scatter_tensor float32 [16]->[8]",
        lambda: dist.reduce_scatter_tensor(torch.empty(8), torch.ones(8 * world)),
    )

    def p2p():
        t = torch.arange(10, dtype=torch.float32)
        if rank == 0:
            dist.send(t, dst=1)
        else:
            dist.recv(t, src=0)

    op("send/recv float32 [10] 0->1", p2p)
    op("barrier", lambda: dist.barrier())
    sub = dist.new_group([0, 1])
    op("subgroup all_reduce float32 [256]", lambda: dist.all_reduce(torch.ones(256), group=sub))
    op("subgroup broadcast int32 [5] src 1", lambda: dist.broadcast(torch.ones(5, dtype=torch.int32), src=1, group=sub))
    op("all_reduce float32 [512] (last)", lambda: dist.all_reduce(torch.ones(512)))

    metafile = os.path.join(outdir, f"meta_rank{rank}.json.part")
    if mode == "normal":
        dump(outdir, rank, meta)
        with open(metafile, "w") as f:
            json.dump(meta, f, indent=1)
        dist.barrier()
        dist.destroy_process_group()
        return

    def late_dump():
        time.sleep(hang_after)
        meta["dumped_at_s"] = hang_after
        dump(outdir, rank, meta)
        with open(metafile, "w") as f:
            json.dump(meta, f, indent=1)

    threading.Thread(target=late_dump, daemon=True).start()
    if rank == 0:
        meta["ops"]["all_reduce float32 [2048] (rank 1 skips it)"] = "issued; blocks"
        dist.all_reduce(torch.ones(2048))  # rank 1 never issues it: blocks until killed (or the 120 s timeout)
    else:
        meta["ops"]["all_reduce float32 [2048] (rank 1 skips it)"] = "skipped; sleeping"
        time.sleep(3600)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--mode", choices=("normal", "hang"), default="normal")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--hang-after", type=float, default=8.0)
    a = ap.parse_args()
    os.makedirs(a.outdir, exist_ok=True)
    port = a.port or free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, 2, port, a.outdir, a.mode, a.hang_after)) for r in range(2)]
    for p in procs:
        p.start()
    metas = [os.path.join(a.outdir, f"meta_rank{r}.json.part") for r in range(2)]
    deadline = time.time() + (a.hang_after + 60 if a.mode == "hang" else 120)
    if a.mode == "hang":
        while time.time() < deadline and not all(os.path.exists(m) for m in metas):
            time.sleep(0.5)
        time.sleep(1.0)
        for p in procs:  # the job is stuck by design: end both ranks (our own children, by pid)
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    else:
        for p in procs:
            p.join(max(1, deadline - time.time()))
            if p.is_alive():
                p.kill()
                p.join()
    codes = [p.exitcode for p in procs]
    merged = {"exitcodes": codes, "ranks": {}}
    for r, m in enumerate(metas):
        if os.path.exists(m):
            with open(m) as f:
                merged["ranks"][r] = json.load(f)
            os.remove(m)
    with open(os.path.join(a.outdir, "meta.json"), "w") as f:
        json.dump(merged, f, indent=1)
    print(json.dumps(merged, indent=1))
    return 0 if a.mode == "hang" or codes == [0, 0] else 1


if __name__ == "__main__":
    sys.exit(main())
