"""MODEL_CARD.md: written from the training report, and read back by the test that checks its figures."""

from __future__ import annotations

from typing import Any, Mapping

CARD_FILE = "MODEL_CARD.md"
# (row label, key in EvalFigures): the rows the CPU test reads back; labels are part of the format.
FIGURE_ROWS = (
    ("next-token accuracy", "next_token_accuracy"),
    ("MTP agreement", "mtp_agreement"),
    ("MTP accuracy (true t+2)", "mtp_accuracy"),
    ("loss (nats/token)", "loss"),
    ("MTP loss (nats/token)", "mtp_loss"),
    ("tokens scored", "tokens"),
)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _table(rows: list[tuple[str, Any]]) -> list[str]:
    return ["| | |", "| --- | --- |", *(f"| {name} | {_fmt(value)} |" for name, value in rows)]


def _figures_section(sample: Mapping[str, Any], full: Mapping[str, Any]) -> list[str]:
    lines = [
        "## Figures",
        "",
        "Measured by the training script after export: the saved bf16 weights loaded back through the engine's loader",
        "in fp32, greedy (argmax) choices, windows of fresh context. MTP agreement is how often the MTP draft for",
        "token t+2 (from h_t and the true t+1) equals the main model's greedy token at t+2 given the true t+1:",
        "the acceptance rate a user sees with one draft token.",
        "",
        "| figure | heldout_sample.txt | full held-out set |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {label} | {_fmt(sample[key])} | {_fmt(full[key])} |" for label, key in FIGURE_ROWS]
    return lines + [""]


def _history_section(history: list[Mapping[str, Any]]) -> list[str]:
    lines = [
        "## Held-out evaluations during training (bf16 autocast, a fixed subset)",
        "",
        "| step | elapsed s | train loss | held-out loss | next-token acc | MTP agreement |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in history:
        lines.append(
            f"| {row['step']} | {row['elapsed_s']:.0f} | {row['train_loss']:.4f} | {row['loss']:.4f} | "
            f"{row['next_token_accuracy']:.4f} | {row['mtp_agreement']:.4f} |"
        )
    return lines + [""]


def render_card(report: Mapping[str, Any]) -> str:
    """The card's Markdown from the report `engine.train.__main__` assembles."""
    corpus, train, env = report["corpus"], report["train"], report["environment"]
    lines = [
        "# strata-tiny",
        "",
        "The embedded default model of Strata (`builtin:strata-tiny`): a small Qwen3-architecture model with one",
        "DeepSeek-style MTP layer, trained from scratch on Python source, so the engine and its MTP drafting can be",
        "tried on any machine with no download. It writes plausible-looking Python; it is not a useful assistant.",
        "",
        *_figures_section(report["sample_figures"], report["full_figures"]),
        "## Corpus",
        "",
        "Python source present on the training machine (the interpreter's standard library and site-packages),",
        "`*.py` only, deduplicated by content hash, generated/minified files dropped, size-capped; split by file on",
        "the content hash into train and held-out.",
        "",
        *_table([(k.replace("_", " "), v) for k, v in corpus.items()]),
        "",
        "## Model",
        "",
        *_table([(k.replace("_", " "), v) for k, v in report["model"].items()]),
        "",
        "## Training",
        "",
        *_table([(k.replace("_", " "), v) for k, v in train.items()]),
        "",
        "Hyper-parameters:",
        "",
        *_table([(k, v) for k, v in report["settings"].items()]),
        "",
        *_history_section(report["history"]),
        "## Environment",
        "",
        *_table([(k.replace("_", " "), v) for k, v in env.items()]),
        "",
        "## Reproduce",
        "",
        "From the repository root, on a machine with one CUDA GPU (the corpus is that machine's own Python):",
        "",
        "```",
        report["command"],
        "```",
        "",
        f"With a time budget the step count is calibrated from the first steps' speed; this run planned "
        f"{train['planned_steps']} steps. To repeat the schedule exactly, add `--steps {train['planned_steps']}`.",
        "",
    ]
    return "\n".join(lines)

