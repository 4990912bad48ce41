"""The tables ``bench_model`` prints: each row's speeds, the breakdown's components, a sliding layer's time over a full
one's, the linear layer at growing lengths, and each row against the limit and against transformers."""

from experiments._bench_rows import PASSES


def print_tables(results: dict, repeats: int, dtype: str, device: str) -> None:
    """The tables of ``results`` (what ``bench_model.run`` returns), timed in ``dtype`` with torch on ``device``."""
    info = results["machine"]
    header = ["shape", "pass", "tokens", "eqmoe ms", "HF ms", "eqmoe tok/s", "HF tok/s", "ratio", "eqmoe compile s"]
    header += ["HF first s", "eqmoe GFLOP/s", "of peak", "HF of peak"]
    print("\n" + markdown_table(header, [row_cells(r) for r in results["rows"]]))
    print("ratio = eqmoe tokens/s / transformers tokens/s (> 1: eqmoe faster); medians of", repeats, "calls")
    print(f"of peak = model FLOPs per second / the {info['matmul_peak_gflops']:.1f} GFLOP/s matmul peak measured above")
    print(f"\neqmoe against the limit and against transformers ({dtype}, torch on {device}):")
    print(summary_table(results["rows"]))
    if results["breakdown"]:
        cells = [
            [b["shape"], b["component"], b["pass"], f"{b['eqmoe_ms']:.2f}", f"{b['hf_ms']:.2f}", f"{b['ratio']:.2f}"]
            + [f"{b['max_abs_diff']:.1e}"]
            for b in results["breakdown"]
        ]
        header = ["shape", "component", "pass", "eqmoe ms", "HF ms", "ratio", "max |diff|"]
        print("\n" + markdown_table(header, cells))
        print("ratio = transformers ms / eqmoe ms (> 1: eqmoe faster); max |diff| of the forward outputs")
    for ratio in results["sliding_over_full"]:
        print(sliding_over_full_line(ratio))
    if results["linear_scaling"]:
        print("\n" + linear_scaling_table(results["linear_scaling"]))
        print(
            "one linear (gated DeltaNet) layer alone, norm included, forward+backward; vs first = per token over the "
            "row's shortest length (flat: linear in the length); temp = XLA's compiled temporary bytes"
        )


def kernel_rates(rates: dict) -> str:
    ours, theirs = rates["jnp_dot_gflops"], rates["torch_mm_gflops"]
    return f"jnp.dot {ours:.1f} GFLOP/s, torch.mm {theirs:.1f} GFLOP/s ({theirs / ours:.2f}x jnp.dot's)"


def summary_table(rows: list[dict]) -> str:
    """One line per row: eqmoe's fraction of the matmul peak and its speed over transformers', forward and train
    (``-`` for a pass not run), and how much faster torch's matmul kernel multiplies the row's expert product than
    XLA's: a step that is matmuls alone on both sides can be at most its inverse as fast as transformers'."""
    by_row: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_row.setdefault(row["shape"], {})[row["pass"]] = row
    cells = []
    for name, passes in by_row.items():
        cells.append([name])
        for pass_name in PASSES:
            row = passes.get(pass_name)
            cells[-1] += [f"{100 * row['eqmoe_of_peak']:.1f}%", f"{row['ratio']:.2f}x"] if row else ["-", "-"]
        rates = next(iter(passes.values()))["expert_matmul"]
        cells[-1].append(f"{rates['torch_mm_gflops'] / rates['jnp_dot_gflops']:.2f}x")
    header = ["row", "forward of peak", "forward vs HF", "train of peak", "train vs HF", "expert matmul torch/XLA"]
    return markdown_table(header, cells)


def row_cells(row: dict) -> list[str]:
    config = row["config"]
    return [
        row["shape"],
        row["pass"],
        f"{config['batch']}x{config['seq']}",
        f"{row['eqmoe_ms']:.1f}",
        f"{row['hf_ms']:.1f}",
        f"{row['eqmoe_tokens_per_s']:,.0f}",
        f"{row['hf_tokens_per_s']:,.0f}",
        f"{row['ratio']:.2f}",
        f"{row['eqmoe_compile_s']:.2f}",
        f"{row['hf_first_call_s']:.2f}",
        f"{row['eqmoe_gflops']:.1f}",
        f"{100 * row['eqmoe_of_peak']:.1f}%",
        f"{100 * row['hf_of_peak']:.1f}%",
    ]


def sliding_over_full_line(ratio: dict) -> str:
    return (
        f"{ratio['shape']}: sliding (window {ratio['window']}) / full attention layer time at "
        f"{ratio['batch']}x{ratio['seq']}: eqmoe forward {ratio['eqmoe_forward']:.3f}, fwd+bwd "
        f"{ratio['eqmoe_fwd+bwd']:.3f}; transformers forward {ratio['hf_forward']:.3f}, "
        f"fwd+bwd {ratio['hf_fwd+bwd']:.3f}"
    )


def linear_scaling_table(entries: list[dict]) -> str:
    cells = [
        [e["shape"], str(e["layer"]), f"{e['batch']}x{e['seq']}", f"{e['eqmoe_ms']:.1f}", f"{e['us_per_token']:.2f}"]
        + [f"{e['per_token_over_first']:.2f}", f"{e['temp_bytes'] / 2**20:,.1f}", f"{e['temp_bytes_per_token']:,.0f}"]
        + [f"{e['temp_per_token_over_first']:.2f}"]
        for e in entries
    ]
    header = ["shape", "layer", "tokens", "fwd+bwd ms", "us/token", "vs first", "temp MiB", "temp B/token", "vs first"]
    return markdown_table(header, cells)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "| " + " | ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])
