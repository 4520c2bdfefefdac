"""A slice of the accuracy-parity eval: the data is complete and labelled, and the harness runs."""
import json
import subprocess
import sys

from helpers import REPO_ROOT

DATA = REPO_ROOT / "evals" / "data"


def test_eval_sets_are_complete_and_labelled():
    sets, total = {}, 0
    for path in DATA.glob("*.jsonl"):
        for line in path.read_text(encoding="utf-8").splitlines():
            doc = json.loads(line)
            assert doc["material"].strip()
            for task in doc["tasks"]:
                spec = task["task"]
                options = json.loads(spec)["options"] if spec.startswith("{") else None
                assert options is None or task["label"] in options
                sets[task["set"]] = sets.get(task["set"], 0) + 1
                total += 1
    assert len(sets) >= 7 and total >= 12351, sets


def test_generator_reproduces_the_committed_data(tmp_path):
    from evals.generate import generate

    for name, rows in generate().items():
        committed = (DATA / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
        assert [json.dumps(r, ensure_ascii=False) for r in rows] == committed


def test_eval_slice_runs(tmp_path):
    out = tmp_path / "report.md"
    subprocess.run([sys.executable, str(REPO_ROOT / "evals" / "run_eval.py"), "--limit", "2", "--out", str(out)],
                   check=True, capture_output=True, timeout=600)
    report = out.read_text()
    for name in ("ticket_team", "ticket_reply_time", "ticket_severity", "contract_compliance",
                 "transaction_fraud", "content_moderation", "document_type", "**all**"):
        assert f"| {name} |" in report
    all_row = next(line for line in report.splitlines() if line.startswith("| **all** |")).split("|")
    decisions, agree_int8 = int(all_row[2]), float(all_row[6])
    assert decisions == 14 and agree_int8 >= 0.85


def test_report_without_the_bf16_reference():
    """`run_eval.py --no-bf16`: the bf16 columns read nan, the int8 and fp32 ones are computed."""
    from evals.run_eval import report

    per_set = {"ticket_team": {"acc_int8": [True, False], "acc_fp32": [True, True], "agree_int8": [True, False],
                               "err_int8": [0.001, 0.003]}}
    text = report(per_set, {"fp32": 1.0, "int8": 2.0}, 2)
    row = next(line for line in text.splitlines() if line.startswith("| **all** |")).split("|")
    assert [c.strip() for c in row[2:12]] == ["2", "0.500", "1.000", "nan", "0.500", "nan", "0.0020", "nan",
                                              "0.0030", "nan"]
    assert "int8 - fp32 = -50.00 points" in text


def test_a_cached_reference_is_used_only_while_it_holds_this_machines_fp32(tmp_path, model_dir, capsys):
    """`--cache`: reused while the first forest's fp32 recomputes within the tolerance (the same bits
    with tolerance 0), saying by how much it moved; recomputed (and rewritten) once it moved more;
    refused for another --limit."""
    import pytest
    from evals.run_eval import _read_json, _write_json, load, references

    cache, docs = tmp_path / "reference.json.gz", load(1)
    first = references(docs, model_dir, cache, bf16=False)
    assert first["drift"] == 0.0
    assert references(docs, model_dir, cache, bf16=False) == first
    assert "computing the reference again" not in capsys.readouterr().out

    stale = _read_json(cache)
    stale["fp32"][0][0] += 1e-7  # what a kernel summing in another order, or another CPU kind, looks like
    _write_json(cache, stale)
    reused = references(docs, model_dir, cache, bf16=False)
    assert reused["fp32"] == stale["fp32"] and 0 < reused["drift"] < 2e-7
    assert "moved by at most" in capsys.readouterr().out
    assert references(docs, model_dir, cache, bf16=False, tolerance=0.0)["fp32"] == first["fp32"]  # bits only
    assert "computing the reference again" in capsys.readouterr().out

    stale = _read_json(cache)
    stale["fp32"][0][0] += 1e-3  # what a changed prompt, checkpoint or model looks like
    _write_json(cache, stale)
    assert references(docs, model_dir, cache, bf16=False)["fp32"] == first["fp32"]
    assert "computing the reference again" in capsys.readouterr().out
    assert _read_json(cache)["fp32"] == first["fp32"]

    with pytest.raises(SystemExit, match="only fits the --limit"):
        references(load(2), model_dir, cache, bf16=False)
