"""The CPU worker's step pieces on the real tiny DeepSeek-V4: the loss over the supervised positions only is the
masked loss over all positions (value and gradients), and the two start-up settings (malloc keeps freed memory,
the collector paused then frozen) do what their docstrings say, each in a process of its own."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import helpers
from helpers import REPO_ROOT
from trainer.compose.compose import validate
from trainer.data import IGNORE_INDEX, Batch
from trainer.launch import cpu_worker


@pytest.fixture(scope="module")
def cfg():
    return validate(helpers.compose("experiment=smoke"))


def batch(rows: int, seq: int, mask: np.ndarray, seed: int = 0) -> Batch:
    """A microbatch as :class:`trainer.data.Rows` makes one: labels the next token, the last position
    ``IGNORE_INDEX`` and unmasked."""
    tokens = np.random.default_rng(seed).integers(0, 129_280, size=(rows, seq), dtype=np.int64)
    labels = np.full_like(tokens, IGNORE_INDEX)
    labels[:, :-1] = tokens[:, 1:]
    loss_mask = mask.astype(np.int64)
    loss_mask[:, -1] = 0
    positions = np.broadcast_to(np.arange(seq, dtype=np.int64), tokens.shape).copy()
    return Batch(tokens, labels, loss_mask, positions, np.arange(rows, dtype=np.int64))


def all_positions_loss(model: torch.nn.Module, mb: Batch, scale: float) -> torch.Tensor:
    """The reference: logits at every position, cross-entropy of each, the masked sum backpropagated."""
    logits = model(input_ids=torch.from_numpy(mb.tokens), position_ids=torch.from_numpy(mb.position_ids)).logits.float()
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), torch.from_numpy(mb.labels).clamp(min=0).reshape(-1), reduction="none"
    )
    loss = (ce * torch.from_numpy(mb.loss_mask).float().reshape(-1)).sum()
    (loss * scale).backward()
    return loss.detach()


@pytest.mark.parametrize("rows", [1, 2])
def test_the_loss_of_the_supervised_positions_only_is_the_masked_loss_of_all(cfg, rows):
    mask = np.random.default_rng(1).integers(0, 2, size=(rows, 48))
    mb = batch(rows, 48, mask)
    ours, reference = cpu_worker.build_model(cfg), cpu_worker.build_model(cfg)
    got = cpu_worker._microbatch_backward(ours, mb, 0.01)
    want = all_positions_loss(reference, mb, 0.01)
    assert int(mb.loss_mask.sum()) > 10 and float(want) > 100.0  # ~11.77 nats per supervised token at random init
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    grads = 0
    for (name, a), (_, b) in zip(ours.named_parameters(), reference.named_parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-7, msg=name)
            grads += 1
    assert grads > 10 and ours.lm_head.weight.grad is not None


def test_a_microbatch_without_supervised_positions_adds_nothing(cfg):
    model = cpu_worker.build_model(cfg)
    loss = cpu_worker._microbatch_backward(model, batch(1, 16, np.zeros((1, 16))), 0.5)
    assert float(loss) == 0.0
    # the vocabulary projection still takes part (a (0, hidden) input): DDP sees the same parameters used on a
    # rank whose microbatch has no supervised token as on the others
    assert model.lm_head.weight.grad is not None and not model.lm_head.weight.grad.any()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def in_own_process(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_freed_memory_is_kept_so_later_steps_touch_no_new_pages():
    # twenty "steps", each 64 MiB of torch (over glibc's largest mmap threshold, 32 MiB) filled and freed with
    # small allocations made beside it: without the setting every step faults its 16,384 pages afresh; with it
    # the heap grows in the first two (glibc before 2.38 asks posix_memalign for size + alignment, so a freed
    # block under a small allocation can be 64 bytes short) and now and then later, and is reused otherwise
    code = """
        import resource, sys
        import torch
        from trainer.launch.cpu_worker import keep_freed_memory
        if sys.argv[1:] == ["keep"]:
            assert keep_freed_memory() is True
        kept, faults = [], []
        for _ in range(20):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            block = torch.empty(64 << 20, dtype=torch.uint8)
            block.fill_(1)
            kept.append([torch.empty(1000) for _ in range(10)])
            del block
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        print(sum(faults[2:]))
    """
    kept = int(in_own_process(code.replace("sys.argv[1:]", '["keep"]')))
    default = int(in_own_process(code))
    assert default > 18 * 16_000 and kept < 3 * 16_384, (default, kept)


def test_the_collector_is_off_in_the_block_then_on_with_what_it_made_frozen():
    out = in_own_process("""
        import gc
        from trainer.launch.cpu_worker import collector_paused
        frozen = gc.get_freeze_count()
        with collector_paused():
            inside = gc.isenabled()
            made = [[i] for i in range(10_000)]
        print(inside, gc.isenabled(), gc.get_freeze_count() - frozen >= 10_000)
        try:
            with collector_paused():
                raise KeyError
        except KeyError:
            print(gc.isenabled())
    """)
    assert out.split() == ["False", "True", "True", "True"]


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
