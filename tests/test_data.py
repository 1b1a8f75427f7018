"""Training text and samples: windows and targets, seeded shuffling, newline starts, exact
resume across an epoch boundary, error messages, the bundled corpus."""
import json

import numpy as np
import pytest

from ggwgpu.data import DataError, Samples, bundled_corpus, read_texts
from ggwgpu.tokenizer import ByteTokenizer

BOS = 1


def test_windows_and_targets():
    tokens = np.arange(100, 110)                                   # 10 tokens
    s = Samples(tokens, n_ctx=4, batch=3, seed=0, bos_id=BOS)
    assert s.n_samples == 7                                        # starts 0..6
    inputs, targets = s.next_batch()
    assert inputs.dtype == targets.dtype == np.int32
    assert inputs.shape == targets.shape == (3, 4)
    for inp, tgt in zip(inputs, targets):
        start = tgt[0] - 100
        assert tgt.tolist() == list(range(100 + start, 104 + start))
        assert inp.tolist() == [BOS] + tgt[:-1].tolist()


def test_one_epoch_visits_every_start_once_then_reshuffles():
    s = Samples(np.arange(20), n_ctx=5, batch=4, seed=3, bos_id=BOS)  # 16 samples
    first = np.concatenate([s.next_batch()[1][:, 0] for _ in range(4)])
    assert sorted(first.tolist()) == list(range(16)) and s.epoch == 1.0
    second = np.concatenate([s.next_batch()[1][:, 0] for _ in range(4)])
    assert sorted(second.tolist()) == list(range(16))
    assert first.tolist() != second.tolist()


def test_shuffle_is_deterministic_by_seed():
    def run(seed):
        s = Samples(np.arange(50), n_ctx=8, batch=5, seed=seed, bos_id=BOS)
        return np.concatenate([s.next_batch()[0] for _ in range(6)])
    assert np.array_equal(run(7), run(7))
    assert not np.array_equal(run(7), run(8))


def test_after_newline_starts():
    tok = ByteTokenizer()
    tokens = tok.encode("ab\ncd\nef\ngh")                          # lines start at 0, 3, 6, 9
    s = Samples(tokens, n_ctx=3, batch=1, seed=0, bos_id=BOS, after_newline=True,
                newline_ids=tok.newline_ids)
    assert s.starts.tolist() == [0, 3, 6]                          # 9 + 3 > 11 tokens
    starts = {tuple(s.next_batch()[1][0]) for _ in range(3)}
    assert starts == {tuple(tok.encode(t)) for t in ("ab\n", "cd\n", "ef\n")}


def test_state_resumes_exactly_across_an_epoch_boundary():
    def make():
        return Samples(np.arange(30), n_ctx=6, batch=4, seed=11, bos_id=BOS)  # 25 samples
    straight = make()
    expected = [straight.next_batch() for _ in range(15)]          # 60 samples: 2.4 epochs
    run = make()
    for _ in range(5):                                             # 20 samples: epoch 0.8
        run.next_batch()
    state = json.loads(json.dumps(run.state()))
    resumed = make()
    resumed.load_state(state)
    assert resumed.epoch == pytest.approx(0.8)
    for want in expected[5:]:                                      # crosses two boundaries
        got = resumed.next_batch()
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert resumed.epoch == pytest.approx(60 / 25)


def test_state_mismatch_and_garbage_are_errors():
    s = Samples(np.arange(30), n_ctx=6, batch=4, seed=0, bos_id=BOS)
    other = Samples(np.arange(40), n_ctx=6, batch=4, seed=0, bos_id=BOS)
    with pytest.raises(DataError, match="25 samples of n_ctx 6, but this data has 35"):
        other.load_state(s.state())
    with pytest.raises(DataError, match="not a sample-order state"):
        s.load_state({"seed": 1})


def test_sample_errors():
    with pytest.raises(DataError, match="the text has 5 tokens, but n_ctx 8 needs at least 8"):
        Samples(np.arange(5), n_ctx=8, batch=1, seed=0, bos_id=BOS)
    tok = ByteTokenizer()
    with pytest.raises(DataError, match="no sample starts after a newline"):
        Samples(tok.encode("no newline here at all"), n_ctx=4, batch=1, seed=0, bos_id=BOS,
                after_newline=True, newline_ids=tok.newline_ids)
    with pytest.raises(DataError, match="newline_ids"):
        Samples(np.arange(9), n_ctx=4, batch=1, seed=0, bos_id=BOS, after_newline=True)
    with pytest.raises(DataError, match="batch"):
        Samples(np.arange(9), n_ctx=4, batch=0, seed=0, bos_id=BOS)


def test_read_texts_concatenates_in_order(tmp_path):
    (tmp_path / "a.txt").write_bytes("first\r\n".encode())
    (tmp_path / "b.txt").write_bytes("sécond".encode())
    assert read_texts([tmp_path / "b.txt", tmp_path / "a.txt"]) == "sécondfirst\r\n"
    assert read_texts(str(tmp_path / "a.txt")) == "first\r\n"


def test_read_texts_errors_name_the_file(tmp_path):
    with pytest.raises(DataError, match="missing.txt: no such file"):
        read_texts([tmp_path / "missing.txt"])
    with pytest.raises(DataError, match="is a directory"):
        read_texts([tmp_path])
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match="empty.txt: is empty"):
        read_texts([tmp_path / "empty.txt"])
    (tmp_path / "latin1.txt").write_bytes(b"ok\ncaf\xe9\n")
    with pytest.raises(DataError, match=r"latin1.txt: not valid UTF-8 at byte offset 6 \(line 2\)"):
        read_texts([tmp_path / "latin1.txt"])
    assert issubclass(DataError, ValueError)


def test_bundled_corpus():
    text = bundled_corpus()
    assert len(text) > 100_000 and text.isascii()
    assert text.startswith("MACBETH") and "THE TEMPEST" in text
    assert text == bundled_corpus("macbeth") + bundled_corpus("tempest")
    assert "PROSPERO" not in bundled_corpus("macbeth")
    with pytest.raises(DataError, match="no bundled text 'hamlet'"):
        bundled_corpus("hamlet")


def test_fifos_devices_and_oversized_texts_are_refused_unread(tmp_path, monkeypatch):
    """A FIFO would block, /dev/zero never ends, a big file takes twice its size: each is
    refused from its stat, before a byte is read."""
    import os

    from ggwgpu import files
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(DataError, match="fifo: is not a regular file"):
        read_texts([tmp_path / "fifo"])
    with pytest.raises(DataError, match="/dev/zero: is not a regular file"):
        read_texts(["/dev/zero"])
    (tmp_path / "big.txt").write_bytes(b"x" * 1001)
    monkeypatch.setenv(files.TEXT_LIMIT_VAR, "1000")
    with pytest.raises(DataError, match=r"big.txt: is 1001 bytes.*over the 1000 bytes.*"
                                        r"GGWGPU_MAX_TEXT_BYTES"):
        read_texts([tmp_path / "big.txt"])
    monkeypatch.setenv(files.TEXT_LIMIT_VAR, "1001")
    assert len(read_texts([tmp_path / "big.txt"])) == 1001
    monkeypatch.setenv(files.TEXT_LIMIT_VAR, "lots")
    with pytest.raises(DataError, match="GGWGPU_MAX_TEXT_BYTES must be a positive number"):
        read_texts([tmp_path / "big.txt"])
    monkeypatch.delenv(files.TEXT_LIMIT_VAR)
    assert files.max_text_bytes() == files.MAX_TEXT_BYTES
