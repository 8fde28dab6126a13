"""Tier (c): a rank dies mid-training, torchrun restarts the group, training resumes from the last checkpoint and
ends in exactly the state of an uninterrupted run.

The training loop below (run as a script under ``torchrun --nproc-per-node 2``) trains a tiny GPT
under a dp=2 FSDP2 (ZeRO-3) plan with AdamW, draws each step's batch from a generator seeded by the step number (so
data does not depend on where a run resumed), and checkpoints every 2 steps with :class:`autopar.codegen.checkpoint.
Checkpointer`.  With ``KILL_AT_STEP=5`` rank 1 ``os._exit(1)``s after step 5 on the first attempt; the restarted
group must resume at step 4 (losing only step 5) and finish all 8 steps.  The final parameters and optimizer states
(gathered to full tensors) must equal those of a run without the kill, bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from autopar.planner.run.torchrun import stop_process_tree

pytestmark = pytest.mark.multiprocess  # every test here starts gloo ranks

STEPS, EVERY, BATCH, SEQ = 8, 2, 4, 16
ROOT = Path(__file__).resolve().parents[2]


def _batch(step: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def train(out_dir: Path) -> None:
    """The torchrun entry point: resume if a checkpoint exists, train to STEPS, write the final gathered state."""
    import torch.distributed as dist

    from autopar import ir
    from autopar.codegen.checkpoint import Checkpointer, CheckpointOptions
    from autopar.codegen.runtime.program import build_program
    from autopar.zoo import build

    from harness import make_plan

    torch.set_num_threads(1)
    # A bounded timeout: should a restarted group's collective hang, it becomes an error that torchrun's next restart
    # recovers from instead of the test's own timeout.
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, attempt = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    spec = build("gpt-tiny", batch=BATCH, device="cpu", seq=SEQ, seed=0)
    graph = ir.trace(spec.model, spec.example_inputs, frontend="fx", model_name="gpt-tiny")
    plan = make_plan(graph, dp=2, zero=3, micro_batch=BATCH // 2, model="gpt-tiny")
    prog = build_program(plan, spec, graph=graph)
    opt = torch.optim.AdamW(prog.parameters(), lr=1e-2, weight_decay=0.1)
    ck = Checkpointer(CheckpointOptions(root=str(out_dir / "ckpt"), every=EVERY, keep=2))
    start = ck.resume(prog, opt)
    if rank == 0:
        with open(out_dir / "attempts.jsonl", "a") as f:
            f.write(json.dumps({"attempt": attempt, "start": start}) + "\n")
    kill_at = int(os.environ.get("KILL_AT_STEP", "0"))
    vocab = spec.config.vocab
    losses = []
    for step in range(start, STEPS):
        x, y = _batch(step, vocab)
        losses.append(prog.step((x,), y))
        opt.step()
        opt.zero_grad(set_to_none=True)
        done = step + 1
        if done == kill_at and attempt == 0 and rank == 1:
            os._exit(1)          # a crashed rank: no cleanup, no checkpoint of step 5
        ck.maybe_save(prog, opt, done)
    state = _gather(prog, opt)
    if rank == 0:
        torch.save({"state": state, "losses": losses}, out_dir / "final.pt")
    dist.barrier()
    dist.destroy_process_group()


def _gather(prog: Any, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    for fqn, p in prog.named_parameters():
        for k, v in [("param", p), *sorted(opt.state[p].items())]:
            out[f"{k}/{fqn}"] = (v.full_tensor() if isinstance(v, DTensor) else v.detach()).cpu().clone()
    return out


def _torchrun(out_dir: Path, kill_at: int, max_restarts: int) -> subprocess.CompletedProcess[str]:
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE, as `autopar run` sets it: a fresh store for each restart, so that the
    # restarted group cannot read the dead attempt's gloo addresses (connection refused, or a hang) from a store that
    # torchrun otherwise keeps across rounds (autopar.planner.run.torchrun.run_plan).
    env = {**os.environ, "KILL_AT_STEP": str(kill_at), "OMP_NUM_THREADS": "1", "TORCH_GLOO_LAZY_INIT": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", str(max_restarts), "--monitor-interval", "0.5", str(Path(__file__).resolve()), str(out_dir)]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        stop_process_tree(proc, grace_s=0)  # torchrun and every worker it started (each in its own session)
        out, err = proc.communicate()
        raise AssertionError(f"torchrun timed out:\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_killed_rank_resumes_from_last_checkpoint_with_identical_state(tmp_path: Path) -> None:
    ref_dir, kill_dir = tmp_path / "ref", tmp_path / "kill"
    ref_dir.mkdir()
    kill_dir.mkdir()
    ref = _torchrun(ref_dir, 0, max_restarts=0)
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = _torchrun(kill_dir, 5, max_restarts=2)
    assert killed.returncode == 0, killed.stderr[-3000:]
    attempts = [json.loads(line) for line in (kill_dir / "attempts.jsonl").read_text().splitlines()]
    # The kill after step 5 loses step 5: the restart resumes from the step-4 checkpoint.  A second restart is
    # allowed only as recovery from a timed-out collective and must resume from a checkpoint too.
    assert attempts[:2] == [{"attempt": 0, "start": 0}, {"attempt": 1, "start": 4}], attempts
    assert all(a["start"] in (4, 6) for a in attempts[2:]), attempts
    a = torch.load(ref_dir / "final.pt")
    b = torch.load(kill_dir / "final.pt")
    last = attempts[-1]["start"]
    assert len(b["losses"]) == STEPS - last
    assert b["losses"] == a["losses"][last:], (a["losses"], b["losses"])
    assert set(a["state"]) == set(b["state"]) and any(k.startswith("exp_avg/") for k in a["state"])
    bad = [k for k in a["state"] if not torch.equal(a["state"][k], b["state"][k])]
    assert not bad, f"resumed run differs from the uninterrupted one: {bad[:5]}"
    # keep=2: only the two newest checkpoints remain, the newest is the last step
    kept = sorted(p.name for p in (kill_dir / "ckpt").glob("step_*"))
    assert kept == ["step_00000006", "step_00000008"], kept


if __name__ == "__main__":
    from autopar.profiles.profiler import exit_without_finalization

    train(Path(sys.argv[1]))
    exit_without_finalization(0)  # as autopar's own worker: gloo's threads can abort the interpreter's teardown
