"""The issues' targets for ``bench peers``: issue 17's at any workload, issue 38's at 800 in / 512 out."""

# polychip output tok/s ratios (the 800 / 512 workload's in LONG_TARGETS)
TARGETS = {"hf-naive": 5.0, "hf-static": 1.7, "llama.cpp": 3.0}
LONG_TARGETS = {"hf-static": 3.0}


def targets_report(res: dict) -> str:
    """Issue 17's targets (issue 38's at 800 / 512), each with the figure measured (against the honest rooflines)
    and whether it is met."""
    eng = res["engines"].get("polychip")
    if eng is None:
        return ""
    rows = ["| target | measured | met |", "|---|---|---|"]

    def add(text, value, ok):   # ok None: no target at this workload, the figure is for information
        rows.append(f"| {text} | {value} | {'-' if ok is None else 'yes' if ok else 'NO'} |")
    long_output = res["config"]["output_len"] >= 512      # our users' workload, 800 / 512
    for peer, want in (TARGETS | LONG_TARGETS if long_output else TARGETS).items():
        if peer in res["ratios"]:
            add(f">= {want}x {res['engines'][peer]['engine']}", f"{res['ratios'][peer]:.2f}x", res["ratios"][peer] >= want)
    want = 80 if long_output else None
    kv = res["config"].get("kv_cache_dtype", "auto")
    add(f"% of workload roofline ({kv} KV)" + (f" >= {want}%" if want else ""), f"{eng['pct_workload_roofline']:.1f}%",
        None if want is None else eng["pct_workload_roofline"] >= want)
    add("single-stream decode, float32 weights, >= 70% of its roofline", f"{eng['pct_decode_roofline']:.1f}%",
        eng["pct_decode_roofline"] >= 70)
    int8, lcpp = res["engines"].get("polychip-int8"), res["engines"].get("llama.cpp")
    if int8 and lcpp:
        add(f"single-stream decode, int8 weights, {kv} KV, ahead of llama.cpp",
            f"{int8['decode_tok_s']:.1f} vs {lcpp['decode_tok_s']:.1f} tok/s", int8["decode_tok_s"] > lcpp["decode_tok_s"])
    if int8 and long_output:
        add(f"single-stream decode, int8 weights, {kv} KV, >= 60% of its roofline", f"{int8['pct_decode_roofline']:.1f}%",
            int8["pct_decode_roofline"] >= 60)
    w8a8 = res["engines"].get("polychip-w8a8")
    if w8a8:   # another model's outputs (int8 activations): for information, not the float32 engine's targets
        peers = ", ".join(f"{w8a8['output_tok_s'] / res['engines'][p]['output_tok_s']:.2f}x {res['engines'][p]['engine']}"
                          for p in ("hf-static", "llama.cpp") if p in res["engines"])
        add("polychip w8a8 (int8 activations): out tok/s, % of its roofline" + (", against" if peers else ""),
            f"{w8a8['output_tok_s']:.1f}, {w8a8['pct_workload_roofline']:.1f}%" + (f", {peers}" if peers else ""), None)
    sp, cold = eng.get("shared_prefix"), 5 if long_output else 4
    if sp:
        add(f"shared {sp['prefix_len']}-token prefix, cold: first wave: mean TTFT >= {cold}x lower",
            f"{sp['ttft_speedup']:.2f}x ({sp['distinct_mean_ttft_s']:.2f} s -> {sp['mean_ttft_s']:.2f} s)",
            sp["ttft_speedup"] >= cold)
        add(f"shared {sp['prefix_len']}-token prefix, warm: prefix cached by an earlier wave: mean TTFT lower",
            f"{sp['warm_ttft_speedup']:.2f}x ({sp['distinct_mean_ttft_s']:.2f} s -> {sp['warm_mean_ttft_s']:.2f} s)",
            None)
    st = eng.get("stage_seconds") or {}
    total = sum(st.values())
    if total:
        over = 100 * (st.get("schedule", 0) + st.get("prepare", 0)) / total
        add("schedule + prepare < 10% of step time", f"{over:.2f}%", over < 10)
    return "\n".join(rows)
