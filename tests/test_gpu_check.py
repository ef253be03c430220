"""bench/gpu_check.py, shrunk with --small so it runs on this CPU: it reports every number the GPU
run reports, and the two invariants it checks hold (and the wrong-denominator control does not)."""
import json

FIELDS = {"mode", "dtype", "trainable_params", "peak_mem_gib", "score_tok_s", "train_tok_s", "gen_tok_s",
          "ratio_max_dev", "grad_rel_err", "grad_rel_err_wrong_denominator", "ratio_ok", "grads_ok"}


def test_small_gpu_check_reports_every_field_and_its_invariants_hold_on_cpu(tmp_path, script, one_thread):
    """The script run as __main__ in this process (torch and the modules it imports are loaded already; a
    new interpreter took ~5 s more): what it prints, writes and exits with is the same."""
    out = tmp_path / "check.json"
    proc = script("bench/gpu_check.py", "--small", "--repeats", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["passed"] and report["small"] and report["device"] == "cpu"
    assert [m["mode"] for m in report["modes"]] == ["lora", "full"]
    lora, full = report["modes"]
    for m in report["modes"]:
        assert set(m) == FIELDS and m["dtype"] == "bf16" and m["peak_mem_gib"] is None  # no CUDA memory to measure
        assert m["ratio_max_dev"] == 0.0  # same kernels and micro-batches with and without grad: exactly 1
        assert m["grad_rel_err"] < 2e-2 < m["grad_rel_err_wrong_denominator"]
        assert min(m["score_tok_s"], m["train_tok_s"], m["gen_tok_s"]) > 0
    assert full["trainable_params"] == report["params"] > lora["trainable_params"]
    assert "| lora | bf16 |" in proc.stdout and "PASSED" in proc.stdout
