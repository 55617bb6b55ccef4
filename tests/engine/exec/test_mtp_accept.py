"""A greedy MTP step's acceptance on the device (engine.exec.mtp_accept): the PyTorch reference on a worked batch,
the one-kernel Triton version against it in Triton's interpreter (CPU tensors), and a CPU engine whose fused MTP
steps run every FUSED_OPS kernel (the acceptance, the rotary tables, the MTP head's norms) giving the tokens and
the accepted drafts of the reference engine."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.exec.mtp_accept import greedy_acceptance
from tests.engine.exec.triton_interpreter import run_in_interpreter, run_kernels_on_cpu

CONTEXT = 64


def _batch(k: int, seed: int, device: str = "cpu") -> dict:
    """Rows of a fused step as views of its packed inputs (slot, draft row, pending, K+1 positions), drafts as a
    view of a wider draft buffer; each row's drafts match the argmax up to a random point; the last row pads."""
    gen = torch.Generator().manual_seed(seed)
    bb = 4
    tokens = torch.randint(0, 50, (bb, k + 1), generator=gen)
    buf = torch.randint(0, 50, (bb, k + 3), generator=gen)
    for row in range(bb):
        keep = int(torch.randint(0, k + 1, (1,), generator=gen))
        buf[row, :keep] = tokens[row, :keep]
    starts = [5, 17, 40, CONTEXT]  # the last row sits at the context's scratch columns: padding
    packed = torch.tensor([[row, row + 10, 7 * row + 1] + [starts[row] + j for j in range(k + 1)]
                           for row in range(bb)])
    tokens, buf, packed = tokens.to(device), buf.to(device), packed.to(device)
    finite = torch.tensor([row != seed % bb for row in range(bb)], device=device)  # one row's logits were NaN
    return {"tokens": tokens, "drafts": buf[:, :k], "slots": packed[:, 0], "draft_rows": packed[:, 1],
            "pending": packed[:, 2:3], "positions": packed[:, 3:], "context_tokens": CONTEXT, "finite": finite}


def test_the_reference_acceptance_on_a_worked_batch():
    tokens = torch.tensor([[11, 12, 13], [21, 22, 23], [31, 32, 33]])
    drafts = torch.tensor([[11, 12], [21, 99], [99, 32]])  # all kept; the first; none (a later match counts not)
    packed = torch.tensor([[0, 5, 10, 3, 4, 5], [1, 6, 20, 8, 9, 10], [2, 7, 30, CONTEXT, CONTEXT + 1, CONTEXT + 2]])
    finite = torch.tensor([True, True, True])
    got = greedy_acceptance(tokens, drafts, packed[:, 0], packed[:, 1], packed[:, 2:3], packed[:, 3:], CONTEXT, finite)
    assert got.accepted.tolist() == [2, 1, 0]
    assert got.emitted.tolist() == [[2, 11, 12, 13], [1, 21, 22, 23], [0, 31, 32, 33]]
    # a row whose logits were not finite emits no token id the host could take for one; its next inputs stay ids
    flagged = greedy_acceptance(tokens, drafts, packed[:, 0], packed[:, 1], packed[:, 2:3], packed[:, 3:], CONTEXT,
                                torch.tensor([True, False, True]))
    assert flagged.emitted.tolist() == [[2, 11, 12, 13], [1, -1, -1, -1], [0, 31, 32, 33]]
    assert torch.equal(flagged.next_inputs, got.next_inputs) and torch.equal(flagged.accepted, got.accepted)
    # a real row's next pending token is tokens[accepted], its positions move by accepted + 1; padding stays
    assert got.next_inputs.tolist() == [[0, 5, 13, 6, 7, 8], [1, 6, 22, 10, 11, 12],
                                        [2, 7, 30, CONTEXT, CONTEXT + 1, CONTEXT + 2]]
    assert got.chain_positions.tolist() == [[6, 7], [10, 11], [CONTEXT + 1, CONTEXT + 2]]


def accept_check() -> None:
    from engine.exec.mtp_accept import greedy_acceptance_kernel

    for k in (1, 2, 3, 4):
        for seed in range(6):
            batch = _batch(k, seed)
            want, got = greedy_acceptance(**batch), greedy_acceptance_kernel(**batch)
            for name, w, g in zip(want._fields, want, got):
                assert g.dtype == torch.long and torch.equal(g, w), (k, seed, name, g.tolist(), w.tolist())


def test_the_acceptance_kernel_in_the_triton_interpreter_matches_the_reference():
    run_in_interpreter("tests.engine.exec.test_mtp_accept", "accept_check")


def fused_engine_check(model: str) -> None:
    """Fused MTP steps (forced on, as on CUDA with graphs) with FUSED_OPS in the interpreter against the separate
    path without it: the same greedy tokens and the same accepted drafts, the acceptance through the kernel."""
    import engine.exec.triton_accept as triton_accept
    from engine.api import SamplingParams
    from tests.engine.engine_helpers import make_engine, random_prompts, run_all, tokens_of

    prompts = random_prompts(3, seed=97, lengths=(20, 60))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def run(fused_ops: bool) -> tuple:
        engine = make_engine(Path(model), batch=3, batch_mtp=True, mtp_depth=2, switches={"FUSED_OPS": fused_ops})
        engine.drafter.fused = fused_ops
        requests, add = {}, engine.add_request
        engine.add_request = lambda rid, prompt, p: requests.setdefault(rid, add(rid, prompt, p))
        outputs = run_all(engine, prompts, params)
        accepted = {rid: list(request.draft_accepted) for rid, request in requests.items()}
        return tokens_of(outputs), accepted, engine

    want, want_accepted, _ = run(False)
    run_kernels_on_cpu()
    calls = []
    real = triton_accept.greedy_accept
    triton_accept.greedy_accept = lambda *a: calls.append(1) or real(*a)
    got, got_accepted, engine = run(True)
    assert engine.runner.model.ops is not None and engine.runner.model.rotary.ops is not None
    assert calls, "the fused steps did not take the acceptance kernel"
    assert sum(map(sum, want_accepted.values())) > 0, "no draft was accepted: the check would see no acceptance"
    assert got == want and got_accepted == want_accepted


def test_fused_mtp_steps_with_every_fused_ops_kernel_in_the_interpreter_give_the_reference_tokens(ckpt):
    run_in_interpreter("tests.engine.exec.test_mtp_accept", "fused_engine_check", str(ckpt))
