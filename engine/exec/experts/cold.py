"""Cold experts: how the expert cache serves a routed expert that is not in its layer's device pool.

Three ways, chosen at start by two switches (docs/SWITCHES.md); all give the all-resident run's greedy tokens,
since only where an expert's weights are read changes, never the sum or its order:
- `copy` (neither switch): the miss is copied host -> slot on the side stream and the layer waits for it;
- `cpu` (EXPERT_CPU): the miss runs on the CPU from the host store, this step (its tokens' rows go to the host and
  the result comes back), as llama.cpp's `--n-cpu-moe`; it is admitted to its slot on the side stream behind the
  step, and the layer's next access waits for that copy, not this one. A captured (graph) step that missed runs
  again eagerly, which serves its misses this way. A miss routed more than CPU_MAX_TOKENS tokens (a prompt
  chunk's) is copied and waited for instead: the CPU's time grows with the tokens, the copy's does not;
- `prefetch` (EXPERT_PREFETCH): while layer L runs, layer L+1's gate applied to layer L's input predicts L+1's
  experts, and those not resident are copied in on the side stream before L+1 asks for them (eager steps); in a
  captured step the graph records the predictions, and after a miss the layers past the first missed one are
  loaded from them before the replay, so one replay fixes several layers.
"""

from __future__ import annotations

import torch

from engine.model.moe import Route, SparseMoE, expert_mlp
from engine.switches import SwitchBoard

COLD_MODES = ("copy", "cpu", "prefetch")
CPU_SWITCH = "EXPERT_CPU"
PREFETCH_SWITCH = "EXPERT_PREFETCH"
# cpu: the most tokens a miss may be routed and still run on the host (a decode or verify step's few rows); one
# routed more (a prompt chunk's) is copied in, as in copy mode
CPU_MAX_TOKENS = 8


def cold_mode(board: SwitchBoard | None) -> str:
    """The mode the switches ask for. Both on: the CPU serves the misses, so none is prefetched, and
    EXPERT_PREFETCH is marked unavailable with that reason (an engine started with every switch still starts)."""
    def on(name: str) -> bool:
        return board is not None and name in board.states and board.enabled(name)

    if on(CPU_SWITCH) and on(PREFETCH_SWITCH):
        board.mark_unavailable(PREFETCH_SWITCH,
                               f"{CPU_SWITCH} is on: a cold expert runs on the CPU, none is prefetched")
    return "cpu" if on(CPU_SWITCH) else "prefetch" if on(PREFETCH_SWITCH) else "copy"


def routed_on_host(y: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, route: Route,
                   w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
    """y[t, j] = weights[t, j] * expert(x[t]) for the (t, j) of `route`, the expert computed where its weights
    are (the host store): the routed tokens' rows go there and the result comes back."""
    token_idx, pos = route
    h = expert_mlp(x[token_idx].to(w_gate_up.device), w_gate_up, w_down).to(y.device)
    y[token_idx, pos] = (h * weights[token_idx, pos, None]).to(y.dtype)


def predicted_ids(block: SparseMoE, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """[N, k] the experts `block` (layer L+1) would route layer L's input `x` to."""
    return block.route(x, positions)[1]
