"""Tests of memo_ext.alloc.snapshot and tools/memory_report.py.

Real snapshots come from shared/data/snapshots beside the repository (see its README); tests
that need them skip where that folder is absent. The expected numbers below are the README's
facts plus event counts read off the files.
"""
import builtins
import functools
import os
import pickle

import numpy as np
import pytest

from tests.conftest import run_memory_report, snapshot_path
from memo_ext.alloc import OomEvent, SnapshotError, load_snapshot, summarize_snapshot

MiB = 1 << 20

# file -> {device: trace events}
EVENTS = {
    "hf_deepseek_coder_1p3b_train_step.pickle": {0: 10307},
    "hf_qwen3_train_expandable_oom.pickle": {0: 6445, 1: 596, 2: 882},
    "llama_infer_multistream.pickle": {0: 10327},
    "transformer_medium_ctx512_train_warm.pickle": {0: 22332},
    "transformer_small_from_empty.pickle": {0: 97},
}


@functools.lru_cache(maxsize=None)
def loaded(name: str) -> dict:
    return load_snapshot(snapshot_path(name))


@functools.lru_cache(maxsize=None)
def summaries(name: str) -> dict:
    return {s.device: s for s in summarize_snapshot(loaded(name))}


# ---------------------------------------------------------------- the real snapshots


@pytest.mark.parametrize("name", sorted(EVENTS))
def test_summary_sanity(name):
    snap = loaded(name)
    by_device = summaries(name)
    assert {d: s.num_events for d, s in by_device.items()} == EVENTS[name]
    for d, s in by_device.items():
        segs = [seg for seg in snap["segments"] if seg["device"] == d]
        # PyTorch records the caller's requested bytes in the trace, not the rounded block size
        assert s.trace_size_field == "requested_size"
        live = [b for seg in segs for b in seg["blocks"] if b["state"] == "active_allocated"]
        assert s.final_allocated_bytes == sum(b["requested_size"] for b in live)
        assert s.final_reserved_bytes == sum(seg["total_size"] for seg in segs)
        assert s.initial_allocated_bytes >= 0 and s.initial_reserved_bytes >= 0
        assert s.peak_allocated_bytes <= s.peak_reserved_bytes
        assert s.allocated_timeline.shape == s.reserved_timeline.shape == (s.num_events,)
        assert np.all(s.allocated_timeline <= s.reserved_timeline)
        assert s.allocated_timeline.max() == s.peak_allocated_bytes
        assert s.allocated_timeline[s.peak_allocated_event] == s.peak_allocated_bytes
        assert s.reserved_timeline.max() == s.peak_reserved_bytes
        assert 0.0 <= s.fragmentation < 1.0
        assert s.num_allocs == sum(e["action"] == "alloc" for e in snap["device_traces"][d])


def test_deepseek_older_format_and_pre_existing_segments():
    name = "hf_deepseek_coder_1p3b_train_step.pickle"
    snap = loaded(name)
    assert "allocator_settings" not in snap
    assert not any("time_us" in e for e in snap["device_traces"][0])
    s = summaries(name)[0]
    assert (s.num_allocs, s.num_segment_alloc, s.num_segment_free) == (3505, 152, 0)
    created = {e["addr"] for e in snap["device_traces"][0] if e["action"] == "segment_alloc"}
    before = [seg for seg in snap["segments"] if seg["address"] not in created]
    assert len(before) == 63
    assert s.initial_reserved_bytes == sum(seg["total_size"] for seg in before)


def test_qwen3_expandable_segments_and_oom():
    name = "hf_qwen3_train_expandable_oom.pickle"
    assert loaded(name)["allocator_settings"]["expandable_segments"] is True
    by_device = summaries(name)
    assert [(s.num_segment_map, s.num_segment_unmap) for s in by_device.values()] == [
        (175, 0), (40, 6), (78, 0)
    ]
    assert all(s.num_segment_alloc == s.num_segment_free == 0 for s in by_device.values())
    assert [s.ooms for s in by_device.values()] == [[], [OomEvent(421, 5308694528, 95682560)], []]
    oom = by_device[1].ooms[0]
    assert round(oom.requested_bytes / 1e9, 2) == 5.31  # the README: "5.31 GB request"
    assert round(oom.device_free_bytes / 1e6, 1) == 95.7  # "95.7 MB free"
    # the process started with the trace: nothing was live before it
    for s in by_device.values():
        assert s.initial_allocated_bytes == s.initial_reserved_bytes == 0


def test_llama_multistream_segment_churn():
    name = "llama_infer_multistream.pickle"
    s = summaries(name)[0]
    assert (s.num_segment_alloc, s.num_segment_free) == (584, 579)
    assert len({e["stream"] for e in loaded(name)["device_traces"][0]}) == 10


def test_medium_warm_cache_reuses_blocks_from_before_the_trace():
    s = summaries("transformer_medium_ctx512_train_warm.pickle")[0]
    assert (s.num_segment_alloc, s.num_segment_free) == (1, 0)
    assert s.num_unmatched_frees > 0  # frees of blocks allocated before recording started
    assert s.initial_allocated_bytes > 0


def test_small_trace_starts_from_empty_allocator():
    s = summaries("transformer_small_from_empty.pickle")[0]
    assert (s.num_events, s.num_segment_alloc) == (97, 9)
    assert s.initial_allocated_bytes == s.initial_reserved_bytes == 0
    assert s.num_unmatched_frees == 0


def test_device_selection():
    snap = loaded("hf_qwen3_train_expandable_oom.pickle")
    assert [s.device for s in summarize_snapshot(snap, device=1)] == [1]
    assert summarize_snapshot(snap, device=3)[0].num_events == 0  # empty trace, no segments
    with pytest.raises(ValueError, match="no device 9"):
        summarize_snapshot(snap, device=9)


# ---------------------------------------------------------------- hand-made snapshots


def _hand_made(trace_size_of_b: int) -> dict:
    """A 2 MiB segment from before the trace holding block A (pre-trace) and block B (traced),
    plus a 20 MiB segment the trace creates."""
    blocks = [
        {"address": 0x1000, "size": 1024, "requested_size": 1000, "state": "active_allocated"},
        {"address": 0x1400, "size": 2048, "requested_size": 2000, "state": "active_allocated"},
        {"address": 0x1C00, "size": 2 * MiB - 3072, "requested_size": 0, "state": "inactive"},
    ]
    trace = [
        {"action": "segment_alloc", "addr": 0x4000000, "size": 20 * MiB},
        {"action": "alloc", "addr": 0x1400, "size": trace_size_of_b},
        {"action": "alloc", "addr": 0x4000000, "size": 300},
        {"action": "free_requested", "addr": 0x4000000, "size": 300},
        {"action": "free_completed", "addr": 0x4000000, "size": 300},
        {"action": "free_completed", "addr": 0x1C00, "size": 700},  # allocated before the trace
        {"action": "oom", "size": 10**12, "device_free": 5},
    ]
    return {
        "segments": [
            {"device": 0, "address": 0x1000, "total_size": 2 * MiB, "blocks": blocks},
            {"device": 0, "address": 0x4000000, "total_size": 20 * MiB, "blocks": []},
        ],
        "device_traces": [trace],
    }


def test_reconstructs_starting_state_in_requested_bytes():
    (s,) = summarize_snapshot(_hand_made(trace_size_of_b=2000))
    assert s.trace_size_field == "requested_size"
    assert (s.final_allocated_bytes, s.initial_allocated_bytes) == (3000, 1000 + 700)
    assert (s.initial_reserved_bytes, s.final_reserved_bytes) == (2 * MiB, 22 * MiB)
    assert s.allocated_timeline.tolist() == [1700, 3700, 4000, 4000, 3700, 3000, 3000]
    assert (s.peak_allocated_bytes, s.peak_allocated_event) == (4000, 2)
    assert (s.num_frees, s.num_unmatched_frees) == (2, 1)
    assert s.ooms == [OomEvent(6, 10**12, 5)]
    assert s.fragmentation == pytest.approx(1 - 4000 / (22 * MiB))


def test_detects_traces_recording_rounded_block_sizes():
    (s,) = summarize_snapshot(_hand_made(trace_size_of_b=2048))
    assert s.trace_size_field == "size"
    assert (s.final_allocated_bytes, s.initial_allocated_bytes) == (3072, 1024 + 700)


def test_trace_contradicting_segments_is_rejected():
    snap = _hand_made(trace_size_of_b=2000)
    extra = {"action": "segment_alloc", "addr": 0x8000000, "size": 64 * MiB}  # not in segments
    snap["device_traces"][0].append(extra)
    with pytest.raises(SnapshotError, match="device 0"):
        summarize_snapshot(snap)


def test_malformed_snapshot_is_rejected():
    snap = _hand_made(trace_size_of_b=2000)
    del snap["segments"][0]["device"]
    with pytest.raises(SnapshotError, match="malformed"):
        summarize_snapshot(snap)


# ---------------------------------------------------------------- the restricted unpickler


class _Call:
    """Pickles as a call of fn(*args) on load: the shape of a malicious pickle."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def test_payload_would_run_under_plain_pickle(tmp_path):
    """Control: the open() payload really creates its file when loaded without restrictions."""
    marker = tmp_path / "control"
    with pickle.loads(pickle.dumps(_Call(builtins.open, str(marker), "w"))):
        pass
    assert marker.exists()


def _nested(payload):
    """The payload hidden inside an otherwise valid snapshot."""
    return {"segments": [], "device_traces": [[{"action": "alloc", "addr": payload, "size": 512}]]}


@pytest.mark.parametrize(
    "fn, make_args, wrap",
    [
        (os.system, lambda m: (f"touch {m}",), lambda p: p),
        (builtins.open, lambda m: (str(m), "w"), lambda p: p),
        (builtins.open, lambda m: (str(m), "w"), _nested),
    ],
    ids=["os.system", "open", "nested-open"],
)
def test_malicious_pickle_is_refused_without_running(tmp_path, fn, make_args, wrap):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps(wrap(_Call(fn, *make_args(marker)))))
    with pytest.raises(SnapshotError, match="refused pickled global") as info:
        load_snapshot(path)
    # pickle names a function by where it is defined: os.system is posix.system, open is io.open
    assert path.name in str(info.value) and f"{fn.__module__}.{fn.__name__}" in str(info.value)
    assert not marker.exists()


def test_not_a_snapshot(tmp_path):
    garbage = tmp_path / "garbage.pickle"
    garbage.write_bytes(b"not a pickle at all")
    with pytest.raises(SnapshotError, match="garbage.pickle: not a readable pickle"):
        load_snapshot(garbage)
    a_list = tmp_path / "list.pickle"
    a_list.write_bytes(pickle.dumps([1, 2, 3]))
    with pytest.raises(SnapshotError, match="not a memory snapshot"):
        load_snapshot(a_list)
    with pytest.raises(FileNotFoundError):
        load_snapshot(tmp_path / "missing.pickle")


# ---------------------------------------------------------------- tools/memory_report.py




def test_report_prints_table_and_plot(tmp_path):
    png = tmp_path / "timeline.png"
    proc = run_memory_report(snapshot_path("hf_qwen3_train_expandable_oom.pickle"), "--plot", png)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("| device | events |")
    assert [line.split("|")[1:3] for line in lines[2:5]] == [
        [" 0 ", " 6445 "], [" 1 ", " 596 "], [" 2 ", " 882 "]
    ]
    assert "OOM on device 1 at event 421" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_single_device():
    proc = run_memory_report(snapshot_path("transformer_small_from_empty.pickle"), "--device", 0)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[2].startswith("| 0 | 97 | 0.00 |")


def test_report_missing_file_exits_2(tmp_path):
    proc = run_memory_report(tmp_path / "missing.pickle")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "cannot read" in proc.stderr


def test_report_rejected_pickle_exits_2(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps(_Call(os.system, f"touch {marker}")))
    proc = run_memory_report(path)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "refused pickled global" in proc.stderr
    assert not marker.exists()


# ---------------------------------------------------------------- truncated and odd files


@pytest.mark.parametrize("cut", ["half", "two-bytes", "empty"])
def test_truncated_files_give_one_line_errors(tmp_path, cut):
    good = pickle.dumps(_hand_made(trace_size_of_b=2000))
    data = {"half": good[: len(good) // 2], "two-bytes": good[:2], "empty": b""}[cut]
    path = tmp_path / "cut.pickle"
    path.write_bytes(data)
    with pytest.raises(SnapshotError, match="cut.pickle: not a readable pickle") as info:
        load_snapshot(path)
    assert "\n" not in str(info.value)
    proc = run_memory_report(path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "not a readable pickle" in proc.stderr


def test_truncated_real_snapshot_is_refused(tmp_path):
    data = snapshot_path("hf_deepseek_coder_1p3b_train_step.pickle").read_bytes()
    path = tmp_path / "deepseek_cut.pickle"
    path.write_bytes(data[: len(data) // 3])
    with pytest.raises(SnapshotError, match="deepseek_cut.pickle: not a readable pickle"):
        load_snapshot(path)


@pytest.mark.parametrize("payload", [
    b"cos\nsystem\n(S'touch PWNED'\ntR.",  # protocol 0: GLOBAL + REDUCE
    b"(S'touch PWNED'\nios\nsystem\n.",  # protocol 0: INST
    (b"\x80\x04\x95\x1d\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x8c\x06system\x93\x8c\x0btouch "
     b"PWNED\x85R."),  # protocol 4: STACK_GLOBAL
], ids=["GLOBAL", "INST", "STACK_GLOBAL"])
def test_every_global_opcode_is_refused(tmp_path, monkeypatch, payload):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "evil.pickle"
    path.write_bytes(payload)
    with pytest.raises(SnapshotError, match="refused pickled global"):
        load_snapshot(path)
    assert not (tmp_path / "PWNED").exists()


def test_garbage_bytes_report_exits_2_with_one_line(tmp_path):
    path = tmp_path / "noise.bin"
    path.write_bytes(bytes(range(256)) * 4)
    proc = run_memory_report(path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "noise.bin" in proc.stderr
