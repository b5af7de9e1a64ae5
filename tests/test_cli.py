"""The ``kvsearch`` command line, run as a subprocess as a user would.

Every command — build, query, info, delete, finetune, rollback, demo and ``--help`` — runs at least once as a subprocess
(the ``kvsearch`` console script), checked on its exit status, its stdout and its stderr: empty on success
(progress bars aside, where they are on), exactly one line on an error. Each run pays the torch import (a
second or two), so variations — every command's help, argument errors, the text form of ``info`` — are
checked in-process through ``main()``. A sharded database (``build --shards 4``) is built, queried, described
and deleted from the same way, and compared with the plain one built from the same file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvsearch
from kvsearch.cli.demo import AUTHORS
from kvsearch.cli.parser import build_parser
from kvsearch.cli.printing import human_size
from kvsearch.cli.program import main
from kvsearch.distributed import ShardedDatabase
from kvsearch.distributed import layout as sharding

SCRIPT = Path(sys.executable).with_name("kvsearch")  # the console script pip installs next to python
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "kvsearch.cli"]
SUBCOMMANDS = ["build", "query", "info", "delete", "finetune", "rollback", "demo"]


# a tqdm line: "desc:  42%|####      | 5/12 [00:01<00:02, 3.9it/s]" or "desc: 4rec [00:00, 6660.27rec/s]"
PROGRESS_BAR = re.compile(r"^[^\[]*\[\d+:\d\d(:\d\d)?[<,]")


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([*COMMAND, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def error_lines(stderr: str) -> list[str]:
    """stderr without tqdm's progress bar lines (tqdm redraws a line with a carriage return)."""
    return [line for line in stderr.splitlines() if line.strip() and not PROGRESS_BAR.match(line)]


def copy_of(built: Path, tmp_path: Path) -> Path:
    db = tmp_path / "names"
    shutil.copytree(built, db)
    return db


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """The authors database built once by ``kvsearch build`` from a CSV file (tests copy it before writing)."""
    folder = tmp_path_factory.mktemp("cli")
    source = folder / "authors.csv"
    source.write_text("last,first\n" + "".join(f"{k},{v}\n" for k, v in AUTHORS.items()))
    result = run("build", str(folder / "names"), "--from", str(source), "--key", "last", "--value", "first")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"added 6 records from {source} to {folder / 'names'} (6 records in all)"
    assert "encoding + indexing" in result.stderr  # the progress bar
    return folder / "names"


def test_query_table_matches_the_engine(built):
    result = run("query", str(built), "Li", "Lipto", "--k", "3", "--temperature", "0.5")
    assert result.returncode == 0, result.stderr
    with kvsearch.Database(built) as db:
        expected = db.query(["Li", "Lipto"], k=3, temperature=0.5)
    blocks = result.stdout.strip().split("\n\n")
    assert [b.splitlines()[0] for b in blocks] == [
        "query 'Li' (softmax): answer 'Mu'",
        "query 'Lipto' (softmax): answer 'Zachary'",
    ]
    for b, block in enumerate(blocks):
        rows = [line.split() for line in block.splitlines()[3:]]  # after the title, header and rule
        order = torch.argsort(expected.weights[b], descending=True)
        assert [r[0] for r in rows] == [expected.keys[b][i] for i in order.tolist()]
        assert [r[1] for r in rows] == [AUTHORS[r[0]] for r in rows]
        torch.testing.assert_close(
            torch.tensor([float(r[2]) for r in rows]), expected.weights[b][order], atol=1e-4, rtol=0
        )


def test_exact_query_json_and_not_found(built):
    result = run("query", str(built), "Li", "Lix", "--pooling", "exact", "--json")
    assert result.returncode == 1
    answers = json.loads(result.stdout)
    assert [(a["query"], a["found"], a["value"]) for a in answers] == [("Li", True, "Mu"), ("Lix", False, None)]
    assert answers[0]["candidates"] == [
        {"id": answers[0]["candidates"][0]["id"], "key": "Li", "value": "Mu", "weight": 1.0, "metadata": {}}
    ]
    assert answers[1]["candidates"] == []
    assert error_lines(result.stderr) == ["kvsearch query: not found: no record has the key 'Lix'"]


def test_info_as_a_user_runs_it(built):
    result = run("info", str(built), "--json")
    assert result.returncode == 0 and result.stderr == ""
    info = json.loads(result.stdout)
    size = sum(f.stat().st_size for f in built.rglob("*") if f.is_file())
    assert info["kind"] == "plain" and info["records"] == 6 and info["indexed"] == 6
    assert (info["dim"], info["value_dim"], info["index"], info["score"]) == (256, 256, "Flat", "cosine")
    assert info["encoder"]["kind"] == "ngram" and info["value_encoder"] == "the key encoder"
    assert info["query_encoder"] is None and info["last_run"] is None  # never fine-tuned
    with kvsearch.Database(built) as db:
        assert (info["generation"], info["previous_generation"]) == (db.generation, None)
    assert info["size_bytes"] == size


def test_info_as_text(built, capsys):
    assert main(["info", str(built)]) == 0  # in-process: the same code without another torch import
    text = capsys.readouterr().out
    with kvsearch.Database(built) as db:
        generation = db.generation
    assert text.splitlines() == [
        f"path           {built}",
        "kind           a database (kvsearch.Database)",
        "records        6",
        "encoder        ngram, dim 256",
        "query encoder  the key encoder",
        "value encoder  the key encoder",
        "index          Flat, score cosine",
        f"generation     {generation} (no previous generation to roll back to)",
        "last run       none",
        f"size on disk   {human_size(sum(f.stat().st_size for f in built.rglob('*') if f.is_file()))}",
    ]


def test_delete_as_a_user_runs_it_then_exact_query_is_not_found(built, tmp_path, capsys):
    db = copy_of(built, tmp_path)
    refused = run("delete", str(db), "Li", "Nobody")
    assert (refused.returncode, refused.stdout) == (1, "")
    assert refused.stderr == "kvsearch delete: error: expected a stored key, got 'Nobody'; nothing was deleted\n"
    deleted = run("delete", str(db), "Li")
    assert (deleted.returncode, deleted.stdout, deleted.stderr) == (0, f"deleted 1 record from {db} (5 left)\n", "")
    assert main(["query", str(db), "Li", "--pooling", "exact"]) == 1  # in-process: one torch import less
    captured = capsys.readouterr()
    assert captured.out.strip() == "query 'Li' (exact): not found"
    assert captured.err == "kvsearch query: not found: no record has the key 'Li'\n"
    with kvsearch.Database(db) as reopened:
        assert len(reopened) == 5 and "Li" not in reopened
        assert reopened.search("Li", k=1)[0].key == "Lipton"


def test_bad_file_is_one_line_and_leaves_nothing(tmp_path):
    source = tmp_path / "bad.jsonl"
    source.write_text('{"key": "a", "value": "1"}\n{"key": "", "value": "2"}\n{oops\n{"key": "a", "value": "3"}\n')
    result = run("build", str(tmp_path / "db"), "--from", str(source))
    assert result.returncode == 1
    (line,) = error_lines(result.stderr)
    assert line.startswith(f"kvsearch build: error: '{source}' has 3 bad rows, nothing was written: line 2: empty key")
    assert "line 3: bad JSON" in line and "line 4: duplicate key 'a' (first on line 1)" in line
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "db").exists()  # a database that the failed build created is removed again
    with pytest.raises(kvsearch.BadFileError):  # --debug lets the exception (and its traceback) through
        main(["--debug", "build", str(tmp_path / "db"), "--from", str(source), "--quiet"])
    assert not (tmp_path / "db").exists()


def test_demo_as_a_user_runs_it(tmp_path):
    result = run("demo", "--path", str(tmp_path / "names"), cwd=tmp_path)  # .ci/run runs `kvsearch demo` too
    assert (result.returncode, result.stderr) == (0, "")  # the sentence model loads silently
    out = result.stdout
    assert "exact lookup \"Li\"            -> 'Mu'" in out
    assert "found=False" in out and "Lipton->Zachary" in out
    assert re.search(r"NgramEncoder  : Lipton \(", out)  # the lexical encoder finds Lipton first for "Li"
    assert (tmp_path / "names" / "store.sqlite").is_file()


TRAIN_PAIRS = "query\ttarget\nLipto\tLipton\nSmolla\tSmola\nZang\tZhang\nWernes\tWerness\nHoo\tHu\nLee\tLi\n"
EVAL_PAIRS = "query\ttarget\nLiptn\tLipton\nSmoal\tSmola\nChang\tZhang\nVerness\tWerness\nWho\tHu\nLii\tLi\n"
EVAL_QUERIES = ["Liptn", "Smoal", "Chang", "Verness", "Who", "Lii"]


def pair_files(tmp_path: Path) -> tuple[Path, Path]:
    """Misspelt authors' names -> the stored key: six training pairs and six held-out ones."""
    (tmp_path / "train.tsv").write_text(TRAIN_PAIRS)
    (tmp_path / "eval.tsv").write_text(EVAL_PAIRS)
    return tmp_path / "train.tsv", tmp_path / "eval.tsv"


def metric_rows(stdout: str) -> tuple[list[str], list[list[str]]]:
    """The header and the rows of the table ``kvsearch finetune`` prints (one row per evaluation)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["epoch", "step"])
    assert set(lines[start + 1].replace(" ", "")) == {"-"}  # the rule under the header
    rows = []
    for line in lines[start + 2 :]:
        cells = line.split()
        if not cells or not cells[0].isdigit():
            break
        rows.append(cells)
    return lines[start].split(), rows


def search_results(path: Path) -> list[list[tuple[str, float]]]:
    """The top 3 (key, score) of each held-out query: what a user of the database gets."""
    with kvsearch.Database(path) as db:
        return [[(h.key, round(h.score, 5)) for h in db.search(q, k=3)] for q in EVAL_QUERIES]


def test_finetune_that_helps_is_kept_then_rolled_back_once(built, tmp_path):
    db = copy_of(built, tmp_path)
    train, held_out = pair_files(tmp_path)
    with kvsearch.Database(db) as opened:
        start = opened.generation
    result = run("finetune", str(db), "--pairs", str(train), "--eval", str(held_out), "--k", "4", "--quiet")
    assert (result.returncode, result.stderr) == (0, "")  # --quiet: no progress bar
    out = result.stdout
    # no pair is generated: the eval pairs name every stored key, and their keys are never trained on
    assert out.startswith(f"fine-tuned {db} on 6 pairs for 3 epochs, evaluated on 6 held-out pairs (")
    header, rows = metric_rows(out)
    assert header == ["epoch", "step", "train", "loss", "recall@1", "recall@4", "MRR"]
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3]  # epoch 0: before training
    assert rows[0][2] == "-" and rows[0][-1] == "(before)"
    kept = [r for r in rows if r[-2:] == ["<-", "kept"]]
    assert len(kept) == 1 and int(kept[0][0]) >= 1
    assert float(kept[0][3]) > float(rows[0][3])  # recall@1 went up: that is why it was kept
    with kvsearch.Database(db) as opened:
        generation, previous = opened.generation, opened.previous_generation
    assert generation != start and previous == start
    assert f"now answers with the fine-tuned retriever: generation {start} -> {generation}" in out
    assert f"'kvsearch rollback {db}' returns to generation {start}" in out
    assert "nothing was committed" not in out

    info = json.loads(run("info", str(db), "--json").stdout)  # the run is recorded with the database
    assert (info["generation"], info["previous_generation"]) == (generation, start)
    # the default for n-grams, train="query+keys": the shared encoder learned; the values keep the untrained one
    assert info["query_encoder"] is None and info["encoder"]["kind"] == "ngram"
    assert info["value_encoder"]["kind"] == "ngram", info["value_encoder"]
    last = info["last_run"]
    assert last["metric"] == "recall@1" and last["kept_epoch"] == int(kept[0][0])
    # the CLI passes only the options given: Python's defaults (train=None is "query+keys" for n-grams)
    assert (last["train"], last["loss"]) == ("query+keys", kvsearch.FinetuneConfig().loss)
    assert round(last["before"], 4) == float(rows[0][3]) and round(last["after"], 4) == float(kept[0][3])
    assert search_results(db) != search_results(built)  # the fine-tuned encoder answers

    rolled = run("rollback", str(db))
    assert (rolled.returncode, rolled.stderr) == (0, "")
    assert rolled.stdout == f"rolled back {db}: generation {generation} -> {start}\n"
    assert search_results(db) == search_results(built)  # exactly the retriever before the run
    again = run("rollback", str(db))  # once only
    assert (again.returncode, again.stdout) == (1, "")
    (line,) = error_lines(again.stderr)
    assert line.startswith("kvsearch rollback: error: ")
    info = json.loads(run("info", str(db), "--json").stdout)
    assert (info["generation"], info["previous_generation"], info["query_encoder"]) == (start, None, None)


def test_finetune_that_makes_things_worse_keeps_the_old_retriever(built, tmp_path, capsys):
    db = copy_of(built, tmp_path)
    train, held_out = pair_files(tmp_path)
    with kvsearch.Database(db) as opened:
        start = opened.generation
    result = run(
        "finetune", str(db), "--pairs", str(train), "--eval", str(held_out), "--k", "4", "--epochs", "1",
        "--lr", "50", "--train", "query", "--generated", "0", "--quiet",
    )  # fmt: skip
    assert (result.returncode, result.stderr) == (0, "")  # not an error: the database is as it was
    out = result.stdout
    header, rows = metric_rows(out)
    assert [int(r[0]) for r in rows] == [0, 1]
    assert rows[0][-4:] == ["<-", "kept", "(the", "start)"] and "kept" not in rows[1]
    assert float(rows[1][3]) < float(rows[0][3])  # lr 50 made recall@1 worse
    assert out.endswith(f"nothing was committed: {db} keeps its old retriever (generation {start} unchanged)\n")
    assert "now answers with the fine-tuned retriever" not in out
    info = json.loads(run("info", str(db), "--json").stdout)
    assert (info["generation"], info["previous_generation"], info["query_encoder"]) == (start, None, None)
    last = info["last_run"]  # the attempt is recorded all the same, and info shows it
    assert (last["committed"], last["kept_epoch"], last["epochs"], last["train"]) == (False, 0, 1, "query")
    assert (last["metric"], round(last["before"], 4), round(last["after"], 4)) == ("recall@1", *[float(rows[0][3])] * 2)
    assert main(["info", str(db)]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("last run")]
    assert line.startswith(f"last run       recall@1 {rows[0][3]} -> {rows[0][3]}, kept epoch 0 of 1 (the start: "
                           "nothing was committed), ")  # fmt: skip
    assert search_results(db) == search_results(built)  # the old retriever answers, exactly
    nothing = run("rollback", str(db))  # nothing was committed, so there is nothing to roll back
    assert (nothing.returncode, nothing.stdout) == (1, "")
    (line,) = error_lines(nothing.stderr)
    assert line.startswith("kvsearch rollback: error: ") and "Traceback" not in nothing.stderr


def test_finetune_keep_last_and_metric_are_passed_on(built, tmp_path, capsys):
    db = copy_of(built, tmp_path)
    train, held_out = pair_files(tmp_path)
    with kvsearch.Database(db) as opened:
        start = opened.generation
    argv = ["finetune", str(db), "--pairs", str(train), "--eval", str(held_out), "--k", "4", "--epochs", "3"]
    before_22 = ["--train", "query", "--lr", "0.01"]  # the defaults this test was written for
    assert main([*argv, "--keep", "last", "--metric", "mrr", *before_22, "--quiet"]) == 0  # in-process
    out = capsys.readouterr().out
    _, rows = metric_rows(out)
    assert [r[-2:] == ["<-", "kept"] for r in rows] == [False, False, False, True]  # the last epoch
    assert float(rows[3][5]) > float(rows[0][5])  # MRR went up
    with kvsearch.Database(db) as opened:
        generation = opened.generation
        assert opened.previous_generation == start
        assert opened.encoders_info()["last_run"]["metric"] == "mrr"
    assert f"generation {start} -> {generation}" in out and "nothing was committed" not in out
    assert main(["info", str(db)]) == 0
    text = capsys.readouterr().out
    assert f"\ngeneration     {generation} (previous {start}: kvsearch rollback returns to it)\n" in text
    assert f"\nlast run       mrr {rows[0][5]} -> {rows[3][5]}, kept epoch 3 of 3, " in text
    assert "\nquery encoder  ngram, dim 256\n" in text


def test_the_finetune_command_has_pythons_defaults_and_choices(capsys):
    from kvsearch.cli.commands import finetune_options
    from kvsearch.training.config import KEEPS, TRAIN_MODES
    from kvsearch.training.losses import LOSSES
    from kvsearch.training.metrics import TARGET_KINDS, TEXT_METRICS
    from kvsearch.training.precision import PRECISIONS

    parser = build_parser()
    python = kvsearch.FinetuneConfig()
    assert finetune_options(parser.parse_args(["finetune", "db"])) == {"verbose": True}  # nothing else passed on
    cli = kvsearch.FinetuneConfig(**finetune_options(parser.parse_args(["finetune", "db"])))
    assert cli == python and (cli.loss, cli.target_kind) == ("retrieval", "key")  # (query text, target key) pairs
    given = parser.parse_args(["finetune", "db", "--loss", "answer", "--epochs", "2", "--quiet"])
    assert finetune_options(given) == {"loss": "answer", "epochs": 2, "verbose": False}
    with pytest.raises(SystemExit):
        parser.parse_args(["finetune", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # the help, its line breaks undone
    for choices in (LOSSES, TARGET_KINDS, TRAIN_MODES, KEEPS, TEXT_METRICS, PRECISIONS):
        assert "{" + ",".join(choices) + "}" in text
    for option in ("epochs", "k", "temperature", "seed", "keep", "loss", "precision", "generated"):
        assert f"default {getattr(python, option)}" in text
    assert f"default {','.join(python.noise)}" in text and "default None" not in text
    assert f"default: {python.target_kind} for the {python.loss} loss, value for the answer losses" in text


def test_finetune_bad_pairs_is_one_line(built, tmp_path, capsys):
    db = copy_of(built, tmp_path)
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("query,target\nLipto,Lipton\n,Smola\n")
    assert main(["finetune", str(db), "--pairs", str(pairs), "--quiet"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"kvsearch finetune: error: '{pairs}' has 1 bad row, nothing was trained: line 3: empty query or target\n"
    )


def test_unknown_targets_of_a_pair_file_name_the_file_and_the_line(built, tmp_path, capsys):
    db = copy_of(built, tmp_path)
    pairs, held_out, values = tmp_path / "pairs.csv", tmp_path / "held_out.tsv", tmp_path / "values.jsonl"
    pairs.write_text("query,target\nLipto,Lipton\n\nSmol,Nobody\nLii,Li\n")  # line 4 (the blank line 3 counts)
    held_out.write_text("query\ttarget\nLipto\tLipton\nZang\tAston\nHoo\tRachel\n")  # value texts, not keys
    values.write_text('{"query": "Lipto", "target": "Zachary"}\n{"query": "Hoo", "target": "Hu"}\n')
    runs = {
        "train": (["--pairs", str(pairs)], f"'{pairs}' has 1 bad row, nothing was trained: line 4: target 'Nobody' "
                  "is no stored key"),
        "eval": (["--pairs", str(pairs.with_name("ok.csv")), "--eval", str(held_out)],
                 f"'{held_out}' has 2 bad rows, nothing was trained: line 3: target 'Aston' is no stored key; line 4: "
                 "target 'Rachel' is no stored key (all or most of these targets are stored value texts: pass "
                 "--targets value --loss answer)"),
        "values": (["--pairs", str(values), "--loss", "answer"], f"'{values}' has 1 bad row, nothing was trained: "
                   "line 2: target 'Hu' is no stored value text (all or most of these targets are stored keys: pass "
                   "--targets key)"),
    }  # fmt: skip
    pairs.with_name("ok.csv").write_text("query,target\nLipto,Lipton\n")
    for argv, message in runs.values():
        assert main(["finetune", str(db), *argv, "--quiet"]) == 1
        captured = capsys.readouterr()
        assert (captured.out, captured.err) == ("", f"kvsearch finetune: error: {message}\n")
    with kvsearch.Database(db) as opened:
        assert opened.previous_generation is None  # nothing was trained


def test_counts_are_singular_for_one(built, tmp_path, capsys):
    from kvsearch.cli.printing import counted

    assert [counted(n, "epoch") for n in (0, 1, 2)] == ["0 epochs", "1 epoch", "2 epochs"]
    assert counted(1, "query", "queries") == "1 query" and counted(3, "query", "queries") == "3 queries"
    source = tmp_path / "one.csv"
    source.write_text("last,first\nLi,Mu\n")
    assert main(["build", str(tmp_path / "one"), "--from", str(source), "--key", "last", "--value", "first",
                 "--quiet"]) == 0  # fmt: skip
    assert capsys.readouterr().out == f"added 1 record from {source} to {tmp_path / 'one'} (1 record in all)\n"
    db = copy_of(built, tmp_path)
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("query,target\nLipto,Lipton\n")
    assert main(["finetune", str(db), "--pairs", str(pairs), "--epochs", "1", "--generated", "0", "--keep", "last",
                 "--quiet"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert out.startswith(f"fine-tuned {db} on 1 pair for 1 epoch (")
    assert "\n1 epoch, loss " in out and "epochs" not in out
    assert main(["info", str(db)]) == 0
    (last_run,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("last run")]
    assert ", 1 step, " in last_run and "epochs" not in last_run and "steps" not in last_run


def test_top_level_help_as_a_user_runs_it():
    result = run("--help")
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.startswith("usage: kvsearch [-h]")
    assert all(f"    {name}" in result.stdout for name in SUBCOMMANDS)


def test_minilm_loads_silently_and_query_prints_only_its_results(tmp_path, capfd):
    """The sentence model's "Loading weights" bar and transformers' messages never show: ``build`` prints only
    its own bars (none with ``--quiet``), and ``kvsearch query`` on a MiniLM database, run as a user runs it,
    prints its result lines on stdout and nothing else, with an empty stderr."""
    source = tmp_path / "authors.csv"
    source.write_text("last,first\n" + "".join(f"{k},{v}\n" for k, v in AUTHORS.items()))
    db = tmp_path / "db"
    # in-process (one model load less): kvsearch's own bars, not the model's
    assert main(["build", str(db), "--from", str(source), "--key", "last", "--value", "first",
                 "--encoder", "minilm"]) == 0  # fmt: skip
    captured = capfd.readouterr()
    assert captured.out == f"added 6 records from {source} to {db} (6 records in all)\n"
    assert "encoding + indexing" in captured.err and "Loading weights" not in captured.err
    assert error_lines(captured.err) == []
    assert main(["query", str(db), "Li", "--json"]) == 0
    captured = capfd.readouterr()
    assert captured.err == "" and json.loads(captured.out)[0]["value"] == "Mu"

    result = run("query", str(db), "Lipto", "--k", "3")
    assert (result.returncode, result.stderr) == (0, "")
    title, header, rule, *rows = result.stdout.splitlines()
    assert re.fullmatch(r"query 'Lipto' \(softmax\): answer '\w+'", title)
    assert header.split() == ["key", "value", "weight"] and set(rule.replace(" ", "")) == {"-"}
    assert len(rows) == 3 and all(AUTHORS[key] == value and 0 < float(weight) < 1 for key, value, weight in
                                  (row.split() for row in rows))  # fmt: skip


def test_python_dash_m_kvsearch_runs_the_command_line(built):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    helped = subprocess.run([sys.executable, "-m", "kvsearch", "--help"], capture_output=True, text=True, env=env)
    assert (helped.returncode, helped.stderr) == (0, "")
    assert helped.stdout == run("--help").stdout  # the same program as the console script
    info = subprocess.run([sys.executable, "-m", "kvsearch", "info", str(built), "--json"], capture_output=True,
                          text=True, env=env)  # fmt: skip
    assert (info.returncode, info.stderr) == (0, "")
    assert json.loads(info.stdout)["records"] == 6


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_command_has_help(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([name, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: kvsearch {name}")


@pytest.mark.parametrize(
    "argv",
    [
        ["query", "db"],
        ["query", "db", "Li", "--k", "0"],
        ["build", "db"],
        ["frobnicate"],
        ["query", "db", "x", "--pooling", "max"],
        ["build", "db", "--from", "a.csv", "--shards", "0"],
        ["build", "db", "--from", "a.csv", "--shards", "-2"],
        ["query", "db", ""],
        ["query", "db", "Li", " \t"],
    ],
)
def test_usage_errors_are_one_line_with_status_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and lines[0].endswith("--help)")


def test_an_empty_query_is_a_usage_error(built, capsys):
    for blank in ("", "   "):
        with pytest.raises(SystemExit) as exit_:
            main(["query", str(built), "Li", blank])
        assert exit_.value.code == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err == (
            f"kvsearch query: error: argument TEXT: expected a non-empty query text, got {blank!r} "
            "(see kvsearch query --help)\n"
        )


@pytest.mark.parametrize(
    ("where", "says"),
    [
        ("{oops", "expected a JSON object such as '{\"year\": {\"$gte\": 2000}}', got '{oops' (Expecting"),
        ('["lang"]', "expected a filter as a dict of field -> condition at where, got ['lang']"),
        ('{"year": {"$after": 2000}}', "expected a filter operator among ("),
        ('{"year": {"$gt": NaN}}', "expected a finite number at where.year.$gt, got nan"),
        ('{"lang": {"$in": "en"}}', "expected a list at where.lang.$in, got str"),
    ],
)
def test_bad_where_is_a_one_line_usage_error(built, where, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["query", str(built), "Li", "--where", where])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert captured.out == "" and line.startswith(f"kvsearch query: error: argument --where: {says}")


def test_metadata_all_stands_alone(tmp_path, capsys):
    source = tmp_path / "a.csv"
    source.write_text("key,value,year\nLi,Mu,2013\n")
    assert main(["build", str(tmp_path / "db"), "--from", str(source), "--metadata", "all", "year"]) == 1
    assert capsys.readouterr().err == (
        "kvsearch build: error: expected --metadata all alone or column names, got all year\n"
    )
    assert not (tmp_path / "db").exists()


def test_commands_on_a_missing_database_do_not_create_one(tmp_path, capsys):
    assert main(["info", str(tmp_path / "nothing")]) == 1
    assert capsys.readouterr().err.strip() == (
        f"kvsearch info: error: no kvsearch database at '{tmp_path / 'nothing'}' (expected a folder with store.sqlite)"
    )
    assert not (tmp_path / "nothing").exists()


def test_a_build_that_fails_before_ingest_leaves_no_folder(tmp_path, capsys):
    source = tmp_path / "a.csv"
    source.write_text("key,value\nLi,Mu\n")
    assert main(["build", str(tmp_path / "db"), "--from", str(source), "--index", "Bogus", "--quiet"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("kvsearch build: error: FAISS cannot build an index from the spec 'Bogus'")
    assert not (tmp_path / "db").exists()


# ---------------------------------------------------------------------- a sharded database (build --shards)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """The authors database built once by ``kvsearch build --shards 4`` (tests copy it before writing)."""
    folder = tmp_path_factory.mktemp("cli-sharded")
    source = folder / "authors.csv"
    source.write_text("last,first\n" + "".join(f"{k},{v}\n" for k, v in AUTHORS.items()))
    db = folder / "people"
    result = run("build", str(db), "--from", str(source), "--key", "last", "--value", "first", "--shards", "4")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"added 6 records from {source} to {db} (6 records in all)\n"
    assert error_lines(result.stderr) == []  # only the progress bars
    assert sharding.is_sharded(db) and not (db / "store.sqlite").exists()
    assert sorted(p.name for p in db.iterdir()) == [
        "shard-0000",
        "shard-0001",
        "shard-0002",
        "shard-0003",
        "shards.json",
    ]
    return db


def per_shard(keys: list[str], num_shards: int = 4) -> list[int]:
    """How many of ``keys`` live on each shard (by the layout's key hash)."""
    counts = [0] * num_shards
    for key in keys:
        counts[sharding.shard_of_key(key, num_shards)] += 1
    return counts


def test_sharded_build_spreads_the_records_by_key_hash(sharded):
    with ShardedDatabase(sharded) as sdb:
        assert (sdb.num_shards, len(sdb)) == (4, 6)
        assert [len(sdb.shards[s]) for s in range(4)] == per_shard(list(AUTHORS))
        assert all(sharding.shard_of_id(h.id) == sharding.shard_of_key(h.key, 4) for h in sdb.search("Li", k=6))
        assert sdb.lookup("Smola") == "Alex"


def test_sharded_query_table_matches_a_plain_database(sharded, built):
    result = run("query", str(sharded), "Li", "Lipto", "--k", "3", "--temperature", "0.5")
    assert (result.returncode, result.stderr) == (0, "")
    plain = run("query", str(built), "Li", "Lipto", "--k", "3", "--temperature", "0.5")
    assert result.stdout == plain.stdout  # same records, same table: keys, values and weights
    blocks = result.stdout.strip().split("\n\n")
    assert [b.splitlines()[0] for b in blocks] == [
        "query 'Li' (softmax): answer 'Mu'",
        "query 'Lipto' (softmax): answer 'Zachary'",
    ]


def test_sharded_query_json_softmax_and_exact(sharded, built):
    result = run("query", str(sharded), "Lipto", "Smolla", "--k", "4", "--json")
    assert (result.returncode, result.stderr) == (0, "")
    answers = json.loads(result.stdout)
    with kvsearch.Database(built) as db:
        expected = db.query(["Lipto", "Smolla"], k=4)
    for b, answer in enumerate(answers):
        order = torch.argsort(expected.weights[b], descending=True).tolist()
        assert [c["key"] for c in answer["candidates"]] == [expected.keys[b][i] for i in order]
        assert [c["value"] for c in answer["candidates"]] == [AUTHORS[c["key"]] for c in answer["candidates"]]
        weights = torch.tensor([c["weight"] for c in answer["candidates"]])
        torch.testing.assert_close(weights, expected.weights[b][order], atol=1e-5, rtol=0)
        assert all(sharding.shard_of_id(c["id"]) == sharding.shard_of_key(c["key"], 4) for c in answer["candidates"])
    assert [(a["query"], a["found"], a["value"]) for a in answers] == [
        ("Lipto", True, "Zachary"),
        ("Smolla", True, "Alex"),
    ]

    exact = run("query", str(sharded), "Li", "Lix", "--pooling", "exact", "--json")
    assert exact.returncode == 1
    answers = json.loads(exact.stdout)
    assert [(a["query"], a["found"], a["value"]) for a in answers] == [("Li", True, "Mu"), ("Lix", False, None)]
    (candidate,) = answers[0]["candidates"]
    assert (candidate["key"], candidate["value"], candidate["weight"]) == ("Li", "Mu", 1.0)
    assert sharding.shard_of_id(candidate["id"]) == sharding.shard_of_key("Li", 4)
    assert answers[1]["candidates"] == []
    assert error_lines(exact.stderr) == ["kvsearch query: not found: no record has the key 'Lix'"]


def test_sharded_query_k_all_is_one_line(sharded, capsys):
    assert main(["query", str(sharded), "Li", "--k", "all"]) == 1  # in-process
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        'kvsearch query: error: k="all" (attention over every record) is not supported across shards yet\n'
    )


def test_sharded_info_as_a_user_runs_it(sharded, capsys):
    result = run("info", str(sharded), "--json")
    assert (result.returncode, result.stderr) == (0, "")
    info = json.loads(result.stdout)
    assert (info["kind"], info["shards"], info["records"], info["indexed"]) == ("sharded", 4, 6, 6)
    assert info["records_per_shard"] == per_shard(list(AUTHORS))
    assert (info["dim"], info["value_dim"], info["index"], info["score"]) == (256, 256, "Flat", "cosine")
    assert info["encoder"]["kind"] == "ngram" and info["value_encoder"] == "the key encoder"
    assert info["query_encoder"] is None
    assert info["size_bytes"] == sum(f.stat().st_size for f in sharded.rglob("*") if f.is_file())

    assert main(["info", str(sharded)]) == 0  # the text form, in-process
    text = capsys.readouterr().out
    assert "\nkind           a sharded database (kvsearch.distributed.ShardedDatabase)\nrecords        6\n" in text
    assert "\nshards         4 (records: " + ", ".join(map(str, per_shard(list(AUTHORS)))) + ")\n" in text
    assert "\nencoder        ngram, dim 256\n" in text and "\nindex          Flat, score cosine\n" in text
    assert "generation" not in text and "last run" not in text


def test_sharded_delete_is_all_or_nothing(sharded, tmp_path, capsys):
    db = tmp_path / "people"
    shutil.copytree(sharded, db)
    nobody = next(k for k in ("Nobody", "Nobody2", "Nobody3") if sharding.shard_of_key(k, 4) > 0)
    assert sharding.shard_of_key("Li", 4) < sharding.shard_of_key(nobody, 4)  # Li's shard comes first
    refused = run("delete", str(db), "Li", nobody)
    assert (refused.returncode, refused.stdout) == (1, "")
    assert refused.stderr == f"kvsearch delete: error: expected a stored key, got {nobody!r}; nothing was deleted\n"
    with ShardedDatabase(db) as sdb:
        assert len(sdb) == 6 and "Li" in sdb  # nothing was deleted, not even on Li's shard
    deleted = run("delete", str(db), "Li")
    assert (deleted.returncode, deleted.stdout, deleted.stderr) == (0, f"deleted 1 record from {db} (5 left)\n", "")
    assert main(["query", str(db), "Li", "--pooling", "exact"]) == 1  # in-process
    captured = capsys.readouterr()
    assert captured.out.strip() == "query 'Li' (exact): not found"
    assert captured.err == "kvsearch query: not found: no record has the key 'Li'\n"
    with ShardedDatabase(db) as sdb:
        assert len(sdb) == 5 and "Li" not in sdb
        assert [len(sdb.shards[s]) for s in range(4)] == per_shard([k for k in AUTHORS if k != "Li"])
        assert sdb.search("Li", k=1)[0].key == "Lipton"


def test_sharded_build_adds_to_an_existing_sharded_database(sharded, tmp_path, capsys):
    db = tmp_path / "people"
    shutil.copytree(sharded, db)
    more = tmp_path / "more.jsonl"
    more.write_text('{"key": "Goodfellow", "value": "Ian"}\n{"key": "Bengio", "value": "Yoshua"}\n')
    assert main(["build", str(db), "--from", str(more), "--quiet"]) == 0  # no --shards: the stored layout
    assert capsys.readouterr().out == f"added 2 records from {more} to {db} (8 records in all)\n"
    again = tmp_path / "again.csv"
    again.write_text("key,value\nNew,One\nSmola,Alex\n")  # Smola is already stored
    assert main(["build", str(db), "--from", str(again), "--quiet"]) == 1
    assert capsys.readouterr().err == (
        f"kvsearch build: error: '{again}' has 1 bad row, nothing was written (1 with a key already stored: to add "
        "the new records and replace the changed ones, upsert with 'kvsearch build --upsert' or "
        "kvsearch.cli.ingest.upsert_file): line 3: key 'Smola' is already stored in the database\n"
    )
    assert main(["build", str(db), "--from", str(more), "--shards", "2", "--quiet"]) == 1
    assert capsys.readouterr().err == f"kvsearch build: error: {db} was created with num_shards=4; got num_shards=2\n"
    with ShardedDatabase(db) as sdb:
        assert len(sdb) == 8 and sdb.lookup("Bengio") == "Yoshua" and "New" not in sdb


def test_a_failed_sharded_build_leaves_nothing(tmp_path, capsys):
    source = tmp_path / "bad.jsonl"
    source.write_text('{"key": "a", "value": "1"}\n{"key": "", "value": "2"}\n')
    result = run("build", str(tmp_path / "db"), "--from", str(source), "--shards", "4")
    assert result.returncode == 1
    (line,) = error_lines(result.stderr)
    assert line == f"kvsearch build: error: '{source}' has 1 bad row, nothing was written: line 2: empty key ''"
    assert not (tmp_path / "db").exists()
    mine = tmp_path / "mine"  # a folder that was there: only what the build wrote goes
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert main(["build", str(mine), "--from", str(source), "--shards", "2", "--quiet"]) == 1
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    assert main(["build", str(tmp_path / "db"), "--from", str(source), "--shards", "2", "--index", "Bogus"]) == 1
    assert not (tmp_path / "db").exists()
    capsys.readouterr()


def test_bad_shards_is_a_usage_error(tmp_path):
    source = tmp_path / "a.csv"
    source.write_text("key,value\nLi,Mu\n")
    result = run("build", str(tmp_path / "db"), "--from", str(source), "--shards", "0")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        "kvsearch build: error: argument --shards: expected a positive integer, got '0' (see kvsearch build --help)\n"
    )
    assert not (tmp_path / "db").exists()


def test_shards_on_a_plain_database_and_finetune_on_a_sharded_one_are_refused(built, sharded, tmp_path, capsys):
    db = copy_of(built, tmp_path)
    source = tmp_path / "a.csv"
    source.write_text("key,value\nNew,One\n")
    assert main(["build", str(db), "--from", str(source), "--shards", "4", "--quiet"]) == 1
    assert capsys.readouterr().err == (
        f"kvsearch build: error: '{db}' holds a database that is not sharded: --shards creates a new sharded "
        "database (choose another folder)\n"
    )
    assert not sharding.is_sharded(db)
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("query,target\nLipto,Lipton\n")
    assert main(["finetune", str(sharded), "--pairs", str(pairs), "--quiet"]) == 1
    assert capsys.readouterr().err == (
        f"kvsearch finetune: error: '{sharded}' is a sharded database: fine-tuning is not supported across shards yet\n"
    )
    assert main(["rollback", str(sharded)]) == 1
    assert "not supported across shards yet" in capsys.readouterr().err
