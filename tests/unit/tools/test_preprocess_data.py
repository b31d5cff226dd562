"""Tests for tools/preprocess_data.py and tools/prepare_demo_data.py.

Covers the indexed dataset contents, empty-document skipping, one-line errors with exit code 2,
atomic outputs, the demo's idempotence, and that megatron-core's GPTDataset samples the output.
"""

import importlib.util
import json
import sys
from pathlib import Path

import numpy
import pytest
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron.training.tokenizer import BytesTokenizer, build_tokenizer
from tests.conftest import REPO_ROOT

TOOLS_DIR = REPO_ROOT / "tools"


def _load_tool(name):
    """Import tools/<name>.py; tools/ is a script directory, not a package."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TOOLS_DIR / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        # Registered before running so that prepare_demo_data's `import preprocess_data` and
        # pickling for --workers find this same module.
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


preprocess_data = _load_tool("preprocess_data")
prepare_demo_data = _load_tool("prepare_demo_data")

DOCUMENTS = ["first document", "", "zweites Dokument: ü", "   ", "third\nwith a newline"]


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def _bytes_argv(input_path, output_prefix, *extra):
    return [
        f"--input={input_path}",
        f"--output-prefix={output_prefix}",
        "--tokenizer-type=BytesTokenizer",
        *extra,
    ]


def _read_documents(prefix):
    dataset = IndexedDataset(str(prefix))
    return [dataset[index].tolist() for index in range(len(dataset))], dataset


def test_writes_documents_with_eod_and_skips_empty(tmp_path, capsys):
    input_path = _write_jsonl(tmp_path / "in.jsonl", [{"text": text} for text in DOCUMENTS])
    stats = preprocess_data.main(_bytes_argv(input_path, tmp_path / "out", "--append-eod"))

    expected_texts = [text for text in DOCUMENTS if text]  # whitespace still has bytes
    eod = BytesTokenizer().eod
    documents, dataset = _read_documents(tmp_path / "out_text_document")
    assert documents == [list(text.encode()) + [eod] for text in expected_texts]
    assert dataset.index.dtype == numpy.uint16  # 257 ids fit in uint16
    assert list(dataset.document_indices) == list(range(len(expected_texts) + 1))
    assert stats["text"].documents == len(expected_texts)
    assert stats["text"].tokens == sum(len(document) for document in documents)
    assert stats["text"].empty_documents == 1
    assert "skipped 1 empty documents" in capsys.readouterr().out


def test_multiple_keys_and_null_tokenizer(tmp_path):
    records = [{"ids": "1 2 3", "other": "7", "unused": 0}, {"ids": "4", "other": ""}]
    input_path = _write_jsonl(tmp_path / "in.jsonl", records)
    stats = preprocess_data.main(
        [
            f"--input={input_path}",
            "--json-keys",
            "ids",
            "other",
            f"--output-prefix={tmp_path / 'out'}",
            "--tokenizer-type=NullTokenizer",
            "--vocab-size=10",
            "--append-eod",
        ]
    )
    assert _read_documents(tmp_path / "out_ids_document")[0] == [[1, 2, 3, 9], [4, 9]]
    assert _read_documents(tmp_path / "out_other_document")[0] == [[7, 9]]
    assert stats["other"].empty_documents == 1


def test_workers_give_identical_output(tmp_path):
    records = [{"text": f"document number {index} " * (index % 7)} for index in range(300)]
    input_path = _write_jsonl(tmp_path / "in.jsonl", records)
    preprocess_data.main(_bytes_argv(input_path, tmp_path / "one", "--workers=1"))
    preprocess_data.main(_bytes_argv(input_path, tmp_path / "two", "--workers=2"))
    for suffix in (".bin", ".idx"):
        one = (tmp_path / f"one_text_document{suffix}").read_bytes()
        two = (tmp_path / f"two_text_document{suffix}").read_bytes()
        assert one == two


def _run_expecting_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        preprocess_data.main(argv)
    assert exit_info.value.code == 2
    error_lines = capsys.readouterr().err.strip().splitlines()
    assert len(error_lines) == 1
    return error_lines[0]


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_json_line_names_the_line_and_leaves_no_files(tmp_path, capsys, workers):
    input_path = tmp_path / "in.jsonl"
    good_lines = [json.dumps({"text": f"good {index}"}) for index in range(200)]
    input_path.write_text("\n".join(good_lines + ["{not json"] + good_lines) + "\n")
    output_dir = tmp_path / "out"
    message = _run_expecting_exit_2(
        _bytes_argv(input_path, output_dir / "data", f"--workers={workers}"), capsys
    )
    assert "line 201" in message and "--input" in message
    assert list(output_dir.iterdir()) == []


def test_failed_rerun_keeps_previous_outputs(tmp_path, capsys):
    input_path = _write_jsonl(tmp_path / "in.jsonl", [{"text": "kept"}])
    preprocess_data.main(_bytes_argv(input_path, tmp_path / "out"))
    before = {path.name: path.read_bytes() for path in tmp_path.glob("out*")}

    _write_jsonl(input_path, [{"text": "new"}, {"body": "no text key"}])
    message = _run_expecting_exit_2(_bytes_argv(input_path, tmp_path / "out"), capsys)
    assert "line 2" in message and "'text'" in message and "--json-keys" in message
    after = {path.name: path.read_bytes() for path in tmp_path.glob("out*")}
    assert after == before


@pytest.mark.parametrize(
    "records, expected_words",
    [
        ([["a", "list"]], ["line 1", "not a JSON object"]),
        ([{"text": 5}], ["line 1", "int, not a string"]),
        ([{"text": ""}, {"text": ""}], ["--input", "no non-empty 'text' documents"]),
    ],
)
def test_invalid_records_are_rejected(tmp_path, capsys, records, expected_words):
    input_path = _write_jsonl(tmp_path / "in.jsonl", records)
    message = _run_expecting_exit_2(_bytes_argv(input_path, tmp_path / "out" / "data"), capsys)
    for words in expected_words:
        assert words in message
    assert list((tmp_path / "out").iterdir()) == []


def test_missing_input_and_tokenizer_errors_exit_2(tmp_path, capsys):
    message = _run_expecting_exit_2(_bytes_argv(tmp_path / "absent.jsonl", tmp_path / "o"), capsys)
    assert "--input" in message and "absent.jsonl" in message

    input_path = _write_jsonl(tmp_path / "in.jsonl", [{"text": "x"}])
    argv = [f"--input={input_path}", f"--output-prefix={tmp_path / 'o'}"]
    message = _run_expecting_exit_2(argv + ["--tokenizer-type=BPETokenizer"], capsys)
    assert "--tokenizer-model" in message
    message = _run_expecting_exit_2(argv + ["--tokenizer-type=NullTokenizer"], capsys)
    assert "--vocab-size" in message


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    """The default BPE demo dataset, built once for the tests below."""
    output_dir = tmp_path_factory.mktemp("demo")
    prepare_demo_data.main([f"--output-dir={output_dir}"])
    return output_dir


def test_demo_data_is_complete_and_consistent(demo_dir):
    manifest = json.loads((demo_dir / "manifest.json").read_text())
    assert manifest["tokenizer_type"] == "BPETokenizer" and manifest["vocab_size"] == 4096
    documents, dataset = _read_documents(demo_dir / manifest["data_path"])
    corpus_lines = (demo_dir / "corpus.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(documents) == len(corpus_lines) == manifest["documents"] > 100
    assert int(dataset.sequence_lengths.sum()) == manifest["tokens"]
    assert all(len(document) > 1 for document in documents)
    assert all(len(json.loads(line)["text"]) <= 8192 for line in corpus_lines)


def test_demo_bpe_documents_decode_back_to_the_corpus(demo_dir):
    tokenizer = build_tokenizer("BPETokenizer", str(demo_dir / "tokenizer.json"), None)
    documents, _ = _read_documents(demo_dir / "demo_text_document")
    corpus_lines = (demo_dir / "corpus.jsonl").read_text(encoding="utf-8").splitlines()
    for index in (0, len(documents) // 2, len(documents) - 1):
        assert documents[index][-1] == tokenizer.eod
        expected_text = json.loads(corpus_lines[index])["text"]
        assert tokenizer.detokenize(documents[index][:-1]) == expected_text


def test_demo_data_second_call_rewrites_nothing(demo_dir, capsys):
    mtimes = {path.name: path.stat().st_mtime_ns for path in demo_dir.iterdir()}
    demo = prepare_demo_data.main([f"--output-dir={demo_dir}"])
    assert not demo.rebuilt
    assert {path.name: path.stat().st_mtime_ns for path in demo_dir.iterdir()} == mtimes
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert last_line == (
        f"--data-path {demo_dir / 'demo_text_document'} --tokenizer-type BPETokenizer "
        f"--tokenizer-model {demo_dir / 'tokenizer.json'}"
    )


def test_demo_data_rebuilds_incomplete_outputs(tmp_path):
    output_dir = tmp_path / "demo"
    first = prepare_demo_data.prepare_demo_data(str(output_dir), "BytesTokenizer", 4096)
    assert first.rebuilt and first.vocab_size == 257
    bin_path = Path(first.data_path + ".bin")
    bin_path.write_bytes(bin_path.read_bytes()[:100])  # simulate an interrupted copy
    second = prepare_demo_data.prepare_demo_data(str(output_dir), "BytesTokenizer", 4096)
    assert second.rebuilt and second.tokens == first.tokens
    assert bin_path.stat().st_size == json.loads((output_dir / "manifest.json").read_text())[
        "file_sizes"
    ]["demo_text_document.bin"]


def test_gpt_dataset_samples_the_demo_data(demo_dir, tmp_path):
    tokenizer = build_tokenizer("BPETokenizer", str(demo_dir / "tokenizer.json"), None)
    sequence_length = 64
    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=sequence_length,
        blend=([str(demo_dir / "demo_text_document")], None),
        split="90,5,5",
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=str(tmp_path / "index_cache"),
    )
    train, valid, test = BlendedMegatronDatasetBuilder(
        GPTDataset, [200, 20, 20], lambda: True, config
    ).build()
    assert len(train) >= 200 and len(valid) >= 20 and len(test) >= 20
    for dataset in (train, valid, test):
        sample = dataset[0]
        assert sample["tokens"].shape == (sequence_length,)
        assert sample["labels"].shape == (sequence_length,)
        assert bool((sample["labels"][:-1] == sample["tokens"][1:]).all())
        assert int(sample["tokens"].max()) < tokenizer.vocab_size
