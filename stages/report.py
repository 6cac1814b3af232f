"""The evaluation report: report.md, report.html (plots embedded), the plots, and figures.json.

What a reader needs to trust a gate decision is on the page:

- each number with its standard error where lm-eval reports one (`0.62 ± 0.019`) and the number of examples it was
  computed on (`n`: a task's questions after `limit`; held-out rows and tokens for perplexity);
- each gate rule with the line the candidate had to stay above (higher is better) or below, `threshold`, which is
  also drawn on that metric's panel;
- one loss panel per training stage, each on its own axis and labelled with what its loss is: cpt's and sft's are
  cross-entropies per token, DPO's is a preference loss that starts at ln 2 ≈ 0.693 (no preference yet), so
  drawing them on one axis would make a working DPO run look like a collapse.

figures.json holds what each plot shows, read back from the drawn figure (each panel's title, axis label and lines),
for tools and tests that should not read pixels.
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path
from typing import Any

from run.masking import mask_secrets_in
from run.run_dir import RunDir, check_still_ours
from spec.fields import TRAINING_STAGES
from spec.pipeline import PipelineSpec

STDERR_SUFFIX = "_stderr"
SAMPLES_METRIC = "n_samples"
"""`<task>/n_samples`: how many of the task's examples its metrics were computed on (lm-eval's `n-samples`,
effective: after `limit`)."""
COLORS = {"base": "#9e9e9e", "champion": "#f0a020", "candidate": "#2070c0"}

LOSSES: dict[str, tuple[str, str, str]] = {
    "cpt": ("cpt: next-token loss", "cross-entropy (nats/token)", "every token of the documents"),
    "sft": ("sft: loss on the answers", "cross-entropy (nats/token)", "the assistant tokens"),
    "dpo": (
        "rlhf: DPO loss",
        "DPO loss, -log sigmoid(beta x margin)",
        "a preference loss, not a cross-entropy: it starts at ln 2 ≈ 0.693, where the chosen and rejected answers "
        "are equally likely, and falls as the policy prefers the chosen answers",
    ),
    "orpo": (
        "rlhf: ORPO loss",
        "cross-entropy + odds-ratio loss",
        "the chosen answers' cross-entropy plus the odds-ratio preference term",
    ),
    "kto": (
        "rlhf: KTO loss",
        "KTO loss",
        "a preference loss over desirable and undesirable answers, about 0.5 at the start, not a cross-entropy",
    ),
    "grpo": (
        "rlhf: GRPO loss",
        "GRPO policy loss",
        "a policy-gradient objective, not a likelihood: it hovers near 0 and may be negative; the rewards say more",
    ),
}
"""Per training stage (rlhf: per algorithm): its loss panel's title, axis label, and what the loss measures."""


# --------------------------------------------------------------------------- metric names


def stderr_name(metric: str) -> str:
    """The metric holding `metric`'s standard error, as lm-eval names it: `arc_easy/acc` -> `arc_easy/acc_stderr`
    (`task/acc/filter` -> `task/acc_stderr/filter`)."""
    task, _, rest = metric.partition("/")
    if not rest:
        return f"{metric}{STDERR_SUFFIX}"
    name, _, filt = rest.partition("/")
    return f"{task}/{name}{STDERR_SUFFIX}" + (f"/{filt}" if filt else "")


def is_companion(metric: str) -> bool:
    """Whether a metric describes another one (a standard error, a task's example count) rather than a score."""
    parts = metric.split("/")
    return (len(parts) > 1 and parts[1].endswith(STDERR_SUFFIX)) or parts[-1] == SAMPLES_METRIC


def sample_count(metric: str, values: dict[str, float]) -> str | None:
    """How many examples `metric` was computed on, as the report writes it, where known."""
    if "/" in metric:
        n = values.get(f"{metric.split('/', 1)[0]}/{SAMPLES_METRIC}")
        return f"{n:.0f}" if n is not None else None
    if metric in ("perplexity", "eval_loss") and "eval_rows" in values:
        tokens = f", {values['eval_tokens']:.0f} tokens" if "eval_tokens" in values else ""
        return f"{values['eval_rows']:.0f} rows{tokens}"
    return None


def with_stderr(metric: str, values: dict[str, float]) -> str:
    """A metric's value, with its standard error where known (`0.62 ± 0.019`); '—' when not measured."""
    stderr = values.get(stderr_name(metric))
    return plus_minus(values.get(metric), stderr if stderr is not None and math.isfinite(stderr) else None)


# --------------------------------------------------------------------------- loss curves


def prepared_data_counts(run_dir: RunDir) -> dict[str, dict[str, Any]]:
    """Each stage's data as prepare recorded it (its stage.json, extra.data): where it is, the rows kept, the rows
    quarantined, the rows dropped by reason and the personal data masked by kind; {} without a prepare record."""
    try:
        result = run_dir.read_result("prepare")
    except ValueError:  # a record that does not parse: the report goes on without it
        return {}
    counts = {}
    for stage, data in ((result.extra.get("data") if result else None) or {}).items():
        counts[stage] = _data_counts(data)
        # a mixture: a line per dataset too, with its share of the stage's training rows and tokens
        for d in data.get("datasets") or []:
            counts[f"{stage} · data.{d.get('index')}"] = _data_counts(d)
    return counts


def _data_counts(data: dict[str, Any]) -> dict[str, Any]:
    """What the report shows of one stage's data, or of one dataset of a mixture."""
    cleaning = data.get("cleaning", {})
    out = {
        "uri": data.get("uri", ""),
        "rows": data.get("rows", 0),
        "quarantined": data.get("quarantined", 0),
        "dropped": cleaning.get("dropped", {}),
        "pii": cleaning.get("pii", {}),
    }
    tokens = data.get("tokens", {}).get("train") if isinstance(data.get("tokens"), dict) else data.get("train_tokens")
    if tokens is not None:
        out["train_tokens"] = tokens
    if "share" in data:
        out["share"] = data["share"]
        out["token_share"] = data.get("token_share")
        out["weight"] = data.get("weight")
    return out


def _share(counts: dict[str, Any]) -> str:
    """'49.2% of rows, 12.6% of tokens (weight 2)' for a dataset of a mixture; '' for a stage."""
    if "share" not in counts:
        return ""
    tokens = f", {counts['token_share']:.1%} of tokens" if counts.get("token_share") is not None else ""
    weight = f" (weight {counts['weight']:g})" if counts.get("weight") is not None else ""
    return f"{counts['share']:.1%} of rows{tokens}{weight}"


def loss_curves(run_dir: RunDir, spec: PipelineSpec) -> dict[str, dict[str, Any]]:
    """Each enabled training stage's training loss: {steps, losses, title, ylabel, note, and for DPO the baseline
    its loss starts from}, from its logged history
    (the trainer's `logs/log_history.json`), else the first and last losses in its stage.json."""
    curves: dict[str, dict[str, Any]] = {}
    for stage in TRAINING_STAGES:
        if not spec.stage(stage).enabled:
            continue
        history = run_dir.stage_dir(stage) / "logs" / "log_history.json"
        points: list[tuple[int, float]] = []
        if history.is_file():
            try:
                entries = json.loads(history.read_text(encoding="utf-8"))
                points = [(int(e["step"]), float(e["loss"])) for e in entries if "loss" in e and "step" in e]
            except (OSError, ValueError, TypeError):
                points = []
        result = run_dir.read_result(stage)
        if not points and result is not None and "train_loss_first" in result.metrics:
            steps = int(result.metrics.get("steps", 1))
            points = [(0, result.metrics["train_loss_first"]), (steps, result.metrics["train_loss_last"])]
        if points:
            kind = spec.stages.rlhf.algorithm if stage == "rlhf" else stage
            title, ylabel, note = LOSSES[kind]
            curves[stage] = {
                "steps": [s for s, _ in points],
                "losses": [loss for _, loss in points],
                "title": title,
                "ylabel": ylabel,
                "note": note,
            }
            if kind == "dpo":  # where a DPO loss starts: the policy prefers neither answer
                curves[stage]["baseline"] = {"y": math.log(2), "label": "ln 2: no preference yet"}
    return curves


# --------------------------------------------------------------------------- plots


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _axes_drawn(fig: Any) -> list[dict[str, Any]]:
    """What each panel of a drawn figure shows: its title, y label, and its lines (label and y values)."""
    return [
        {
            "title": ax.get_title(),
            "ylabel": ax.get_ylabel(),
            "lines": [
                {"label": str(line.get_label()), "y": [float(y) for y in line.get_ydata()]} for line in ax.get_lines()
            ],
        }
        for ax in fig.axes
    ]


def metric_panels(
    columns: dict[str, dict[str, float]], metrics: list[str], checks: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One panel per metric: the bars (base, champion, candidate, each with its standard error and n where known)
    and, for a gated metric, the gate's threshold."""
    panels = []
    for metric in metrics:
        bars = [
            {
                "name": name,
                "value": values[metric],
                "stderr": values.get(stderr_name(metric)),
                "n": sample_count(metric, values),
            }
            for name, values in columns.items()
            if metric in values
        ]
        panel: dict[str, Any] = {"metric": metric, "bars": bars, "threshold": None, "threshold_label": None}
        for check in checks:
            if check["metric"] == metric and check.get("threshold") is not None:
                sign = "≥" if check["higher_is_better"] else "≤"
                panel["threshold"] = check["threshold"]
                panel["threshold_label"] = f"gate: candidate {sign} {check['threshold']:.4g}"
        panels.append(panel)
    return panels


def plot_metrics(path: Path, panels: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Bars of each metric for base, champion and candidate (one panel per metric: scales differ), with standard
    errors as error bars and the gate's threshold as a dashed line; returns the panels as drawn."""
    if not panels:
        return None
    plt = _pyplot()
    per_row = min(len(panels), 4)
    rows = math.ceil(len(panels) / per_row)
    fig, axes = plt.subplots(rows, per_row, figsize=(3.2 * per_row, 3.4 * rows), dpi=100, squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        bars = panel["bars"]
        errors = [b["stderr"] if b["stderr"] is not None else 0.0 for b in bars]
        drawn = ax.bar(
            [b["name"] for b in bars],
            [b["value"] for b in bars],
            yerr=errors if any(errors) else None,
            capsize=4,
            color=[COLORS.get(b["name"], "#606060") for b in bars],
        )
        ax.bar_label(drawn, labels=[f"{b['value']:.4g}" for b in bars], fontsize=8)
        if panel["threshold"] is not None:
            ax.axhline(panel["threshold"], color="#c00000", linestyle="--", linewidth=1, label=panel["threshold_label"])
            ax.legend(fontsize=7, loc="lower right")
        ax.set_title(panel["metric"], fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        fig.delaxes(ax)
    fig.tight_layout()
    fig.savefig(path)
    drawn_axes = _axes_drawn(fig)
    plt.close(fig)
    return drawn_axes


def plot_loss_curves(path: Path, curves: dict[str, dict[str, Any]]) -> list[dict[str, Any]] | None:
    """One panel per training stage, each on its own axis and labelled with what its loss is (a DPO loss is not
    on a cross-entropy's scale); returns the panels as drawn."""
    if not curves:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(curves), figsize=(4.2 * len(curves), 3.4), dpi=100, squeeze=False)
    for ax, (stage, curve) in zip(axes[0], curves.items(), strict=True):
        ax.plot(curve["steps"], curve["losses"], marker="o", markersize=2, color="#2070c0", label=stage)
        if baseline := curve.get("baseline"):
            ax.axhline(baseline["y"], color="#808080", linestyle=":", linewidth=1, label=baseline["label"])
            ax.legend(fontsize=7)
        ax.set_title(curve["title"], fontsize=9)
        ax.set_xlabel(f"{stage} step", fontsize=8)
        ax.set_ylabel(curve["ylabel"], fontsize=8)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    drawn_axes = _axes_drawn(fig)
    plt.close(fig)
    return drawn_axes


# --------------------------------------------------------------------------- the report


def _md(text: str) -> str:
    """Text fit for a Markdown table cell."""
    return html.escape(text).replace("|", "\\|").replace("\n", "<br>") or " "


def _allowed(check: dict[str, Any]) -> str:
    """A gate rule's allowance as the report writes it."""
    text = f"{check['max_regression']:g}"
    if check.get("max_regression_relative") is not None:
        text = f"max({text}, {check['max_regression_relative']:.4g} x reference)"
        if check.get("allowed") is not None:
            text += f" = {check['allowed']:.4g}"
    if check.get("min_significance") is not None:
        text += f"; better by more than {check['min_significance']:g} se"
    return text


def _threshold(check: dict[str, Any]) -> str:
    """The line a gate rule held the candidate to (`≥ 0.57`), where it could be drawn."""
    if check.get("threshold") is None:
        return "—"
    return ("≥ " if check["higher_is_better"] else "≤ ") + f"{check['threshold']:.6g}"


def plus_minus(value: float | None, stderr: float | None = None) -> str:
    """A value with its standard error where known (`0.62 ± 0.019`); '—' for none."""
    if value is None:
        return "—"
    return f"{value:.6g}" + (f" ± {stderr:.2g}" if stderr is not None else "")


def write_report(out_dir: Path, facts: dict[str, Any]) -> list[Path]:
    """report.md, report.html (images embedded), the plots and figures.json, with the decision, the gate (rules,
    thresholds, standard errors), the metrics (± standard error, n), the generations and the loss panels; returns
    the files written. Secret values and credential shapes in any text (an error message holding a tracking URI, a
    generation repeating a token) are masked."""
    facts = mask_secrets_in(facts)
    check_still_ours(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    columns = {"base": facts["base"], "champion": facts["champion"], "candidate": facts["candidate"]}
    if not facts["champion"]:
        columns.pop("champion")
    metrics = sorted({m for values in columns.values() for m in values if not is_companion(m)})
    shown = [m for m in metrics if not m.startswith("eval_rows") and m != "eval_tokens"]
    checks = facts["gate_checks"]
    curves: dict[str, dict[str, Any]] = facts["loss_curves"]
    figures: dict[str, Any] = {}
    panels = metric_panels(columns, shown, checks)
    if (drawn := plot_metrics(out_dir / "metrics.png", panels)) is not None:
        figures["metrics"] = {"file": "metrics.png", "panels": panels, "axes": drawn}
    if (drawn := plot_loss_curves(out_dir / "loss_curves.png", curves)) is not None:
        figures["loss_curves"] = {"file": "loss_curves.png", "panels": curves, "axes": drawn}
    plots = [out_dir / figure["file"] for figure in figures.values()]
    figures_path = out_dir / "figures.json"
    figures_path.write_text(json.dumps(figures, ensure_ascii=False, indent=2), encoding="utf-8")

    champion = facts["champion_version"]
    title = f"Evaluation of {facts['run']} ({facts['pipeline']})"
    summary = [
        f"candidate: output of the {facts['candidate_stage']} stage",
        f"base model: {facts['base_model']}",
        *(
            [f"base model numbers from the score cache: {', '.join(f'{p} (run {r})' for p, r in cached.items())}"]
            if (cached := facts.get("base_cached"))
            else []
        ),
        f"champion: {facts['registered_model']} version {champion}" if champion else "champion: none yet",
        *[
            f"champion measured again ({', '.join(m for m, w in facts['champion_remeasured'].items() if w == why)}): "
            + why
            for why in dict.fromkeys(facts["champion_remeasured"].values())
        ],
        f"held-out data: {facts['perplexity_data'] or 'none'}",
        f"lm-eval tasks: {', '.join(facts['lm_eval_tasks']) or 'none'}"
        + (f" (limit {facts['limit']})" if facts["limit"] else ""),
        "± is the standard error lm-eval reports (for a mean such as acc: the sample standard deviation / sqrt(n)); "
        "n is the number of examples a number was computed on (for perplexity: held-out rows and scored tokens)",
    ]
    gate_header = ["metric", "better", "allowed regression", "threshold", "candidate", "reference", "result"]
    gate_rows = [
        [
            c["metric"],
            "higher" if c["higher_is_better"] else "lower",
            _allowed(c),
            _threshold(c),
            plus_minus(c["candidate"], c.get("candidate_stderr")),
            f"{plus_minus(c['reference'], c.get('reference_stderr'))} ({c['reference_name']})",
            "pass" if c["passed"] else "FAIL",
        ]
        for c in checks
    ]
    metric_rows = []
    for metric in metrics:
        counts = {name: sample_count(metric, values) for name, values in columns.items() if metric in values}
        n = counts.get("candidate") or next((c for c in counts.values() if c), None)
        cells = [
            with_stderr(metric, values) + (f" (n={counts[name]})" if counts.get(name) not in (None, n) else "")
            for name, values in columns.items()
        ]
        metric_rows.append([metric, n or "—", *cells])
    metric_header = ["metric", "n", *columns]
    loss_lines = [
        f"{curve['title']}, {curve['losses'][0]:.4g} at step {curve['steps'][0]} to {curve['losses'][-1]:.4g} at "
        f"step {curve['steps'][-1]}: {curve['note']}"
        for curve in curves.values()
    ]
    gens = [
        list(r) for r in zip(facts["prompts"], facts["base_generations"], facts["candidate_generations"], strict=True)
    ]

    data_header = [
        "stage",
        "data",
        "rows",
        "training tokens",
        "share (rows, tokens)",
        "quarantined",
        "dropped",
        "personal data masked",
    ]
    data_rows = [
        [
            stage,
            str(counts.get("uri", "")),
            f"{counts.get('rows', 0):,}",
            f"{counts['train_tokens']:,}" if counts.get("train_tokens") is not None else "",
            _share(counts),
            f"{counts.get('quarantined', 0):,}",
            ", ".join(f"{n:,} {why}" for why, n in counts.get("dropped", {}).items() if n) or "none",
            ", ".join(f"{n:,} {kind}" for kind, n in counts.get("pii", {}).items() if n) or "none",
        ]
        for stage, counts in facts.get("data", {}).items()
    ]

    def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
        return [
            "| " + " | ".join(header) + " |",
            "|---" * len(header) + "|",
            *["| " + " | ".join(_md(c) for c in row) + " |" for row in rows],
        ]

    md = [f"# {title}", "", f"**Gate: {facts['gate'].upper()}** against the {facts['reference']}.", ""]
    md += [f"- {_md(line)}" for line in summary]
    md += ["", "## Gate", "", *md_table(gate_header, gate_rows)]
    md += ["", *[f"- {_md(r)}" for r in facts["gate_reasons"]], ""]
    md += ["## Metrics", "", *md_table(metric_header, metric_rows)]
    if facts["errors"]:
        md += ["", "Errors while measuring:", "", *[f"- {_md(e)}" for e in facts["errors"]]]
    if gens:
        md += ["", "## Generations", "", *md_table(["prompt", "base", "candidate"], gens)]
    if data_rows:
        md += ["", "## Training data", "", "What prepare kept of each stage's data (prepare's stage.json).", ""]
        md += md_table(data_header, data_rows)
    if loss_lines:
        md += ["", "## Training loss", "", "One panel per stage: their losses measure different things.", ""]
        md += [f"- {_md(line)}" for line in loss_lines]
    md += ["", "## Plots", "", *[f"![{p.stem}]({p.name})" for p in plots], ""]
    md_path = out_dir / "report.md"
    md_path.write_text("\n".join(md), encoding="utf-8")

    def table(header: list[str], rows: list[list[str]]) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    images = "".join(
        f'<figure><img alt="{name}" src="data:image/png;base64,'
        f'{base64.b64encode((out_dir / figure["file"]).read_bytes()).decode()}">'
        f"<figcaption>{html.escape(' | '.join(a['title'] for a in figure['axes']))}</figcaption></figure>"
        for name, figure in figures.items()
    )
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top;white-space:pre-wrap}}
.pass{{color:#080}}.fail{{color:#c00}}img{{max-width:100%}}</style></head><body>
<h1>{html.escape(title)}</h1>
<p class="{facts["gate"]}"><b>Gate: {facts["gate"].upper()}</b> against the {html.escape(facts["reference"])}.</p>
<ul>{"".join(f"<li>{html.escape(line)}</li>" for line in summary)}</ul>
<h2>Gate</h2>{table(gate_header, gate_rows)}
<ul>{"".join(f"<li>{html.escape(r)}</li>" for r in facts["gate_reasons"])}</ul>
<h2>Metrics</h2>{table(metric_header, metric_rows)}
{"".join(f"<p class='fail'>{html.escape(e)}</p>" for e in facts["errors"])}
<h2>Generations</h2>{table(["prompt", "base", "candidate"], gens) if gens else "<p>No prompts.</p>"}
<h2>Training data</h2>{table(data_header, data_rows) if data_rows else "<p>No prepare record.</p>"}
<h2>Training loss</h2><ul>{"".join(f"<li>{html.escape(line)}</li>" for line in loss_lines)}</ul>
<h2>Plots</h2>{images}
</body></html>
"""
    html_path = out_dir / "report.html"
    html_path.write_text(page, encoding="utf-8")
    return [md_path, html_path, figures_path, *plots]
