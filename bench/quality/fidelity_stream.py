"""Fidelity on live traffic, as deployed: does the service's controller hold its target, and
at what compute, against every fixed budget on the same stream?

    kvcraft bench fidelity-stream --task short --requests 300 --json docs/results/fidelity-short-seed1.json
    kvcraft bench fidelity-stream --task long --requests 300 --json docs/results/fidelity-long-seed1.json
    kvcraft bench fidelity-stream --task musique --data musique_s.json --requests 300 --new-tokens 16 \\
        --json docs/results/fidelity-musique-300.json
    (--sweep query:budget=0.05 ... narrows the fixed-budget sweep; --sweep none skips it;
    --state DIR keeps the adaptive run's service data and progress: a run stopped with
    --stop-after N or Ctrl-C, or killed, goes on from its last request when the same command runs
    again; DIR without its data/, elsewhere, on the service's tallies that progress.json kept)

A stream of N requests, each served once, in order, every request counted (the first ones
too), on held-out draws:

- `short`, `long`: the synthetic tasks and their small trained models, the stream of
  `kvbench.quality.deployed.requests` (per example: its chunks shuffled among 2 chunks of
  the next example, then the example as retrieved), seed 1 by default;
- `musique`: SmolLM2-135M-Instruct (`kvcraft model fetch`) over MuSiQue's held-out records
  (0-119 of CacheBlend's `musique_s.json`), `--passages` (3) passages a prompt in the layout
  of `kvbench.common.musique.prompt`; per record: its passages shuffled among `--neighbours` (1)
  passages of the next record (record 0's for the last), behind the instruction, with its
  question; then the record as retrieved. After every record's two, a second retrieval of
  each record's question, in the same order of records: its passages 2..k+1 (the first
  dropped, the next one in the file's ranking added: a chunk no request stored; at
  `--passages 10`, MuSiQue's all, the same ten with the first ranked last). 120 records
  give at most 360 requests.

Runs, each on a fresh `kvcraft serve` (its default configuration, an empty data dir):

1. **adaptive**: `RAGAdapter(engine, client)` as deployed (the default policy at the budget
   each Plan gives, shadow prefills on). Beside every request the benchmark computes full
   prefill of the same tokens itself (the reference, not the service's), after the request
   and its `flush()` (store-back and the shadow: as a slower stream would, so the next Plan
   carries the sample; never inside TTFT). Per request: the budget it ran with, whether it
   was blended (stored KV used) and sampled, the true top-1 agreement (served first-token
   argmax == full prefill's at the last prompt position); with `--new-tokens` the request
   also decodes its answer (`RAGAdapter.generate`, greedy) and the benchmark counts the
   answer's tokens after the first that full prefill, fed the served answer, predicts as
   served (teacher forcing, the first 16: what the shadows measure); the computed share (row-layers
   computed / prompt tokens x layers; 1 when served by plain prefill), TTFT (`ttft_s`). At
   the end the service's Admin Stats (`fidelity` per policy and budget, `budgets`) and the
   adapter's `sampling_cost()`.
2. **sweep**: the same request sequence, a fresh service per policy, shadows off: `query`
   at each budget of the controller's ladder below 1, `naive`, `cacheblend:budget=0.15`
   (on the 4-layer synthetic models a budget of 15% is below layer 0 alone, refused:
   `cacheblend:ratio=0.15` there, CacheBlend's r, as the tables of docs/quality.md), against
   the same references; with `--new-tokens` each decodes its answers too, compared as the
   adaptive run's (a full prefill of the prompt and the policy's own answer per request).

Reported (`report`): the adaptive run's budget trajectory, its settled budget (the one in
force from the last change on), true agreement and computed share of the requests from the
settle on, samples, the sampling's cost, TTFT of sampled and unsampled requests; per budget
it served, the service's Wilson 95% interval against the true agreement of all its requests
at that budget (and of its blended requests alone: the ones the samples stand for); the sweep
with standard errors sqrt(p(1-p)/n); the smallest fixed budget whose true agreement >= the
target, and the adaptive run's settled computed share over that budget's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

from kvbench import results
from kvbench.common.args import count
from kvbench.quality.stream_report import mean, print_report, report
from kvbench.report.streams import ANSWER_TOKENS
from kvclient.fidelity import fidelity_record
from kvservice.fidelity import LADDER

ADAPTIVE = "adaptive"
TASKS = ("short", "long", "musique")

Request = tuple[list[list[int]], list[int]]  # (chunks in retriever order, question)


@dataclass
class Served:
    """One request of a run."""

    budget: float  # RequestReport.budget (0: the policy has none)
    blended: bool  # stored KV of at least one chunk served it
    sampled: bool  # a shadow prefill measured it
    agree: bool  # served first-token argmax == the reference's
    share: float  # row-layers computed / prompt row-layers
    ttft_s: float
    prompt_tokens: int
    fallbacks: int = 0
    plan_failed: bool = False
    as_retrieved: bool = False  # every chunk of its prompt was in an earlier request (`retrieved`)
    answer_tokens: int = 0  # answer tokens after the first compared with full prefill (teacher forcing)
    answer_agree: int = 0  # of those, full prefill's next token is the served one
    near_tie: bool = False  # blended, then served by full prefill (RequestReport.near_tie)
    blend_skipped: bool = False  # served by exact reuse at its Plan's budget (RequestReport.blend_skipped)


# -- the streams ---------------------------------------------------------------------


def synthetic_stream(task: str, n: int, seed: int) -> list[Request]:
    from kvbench.quality.deployed import requests

    return [(chunks, question) for chunks, question, _ in requests(task, (n + 1) // 2, seed)][:n]


def musique_stream(tok, records: Sequence, n: int, seed: int, neighbours: int = 1,  # noqa: ANN001
                   passages: int = 3) -> list[Request]:
    """Per record: its first `passages` passages shuffled among `neighbours` passages of the
    next record (of the first, for the last), behind the instruction, its question; then the
    record as retrieved. Then per record, in the same order, a second retrieval: its passages
    2..passages+1, or where the record has no more passages than that (MuSiQue's ten, at ten
    a prompt) the same passages with the first ranked last. The first n requests."""
    from kvbench.common import musique

    prompts = [musique.prompt(tok, dataclasses.replace(r, passages=r.passages[:passages])) for r in records]
    rng = random.Random(seed)
    out: list[Request] = []
    for i, p in enumerate(prompts):
        nxt = prompts[(i + 1) % len(prompts)]
        mixed = [list(c) for c in p.passages] + [list(c) for c in nxt.passages[:neighbours]]
        rng.shuffle(mixed)
        out.append(([list(p.instruction), *mixed], list(p.question)))
        out.append(([list(c) for c in p.chunks()], list(p.question)))
    if n > len(out):
        for r in records:
            if len(r.passages) < passages:
                raise SystemExit(f"record {r.id} has {len(r.passages)} passages, fewer than {passages}")
            again = r.passages[1:passages + 1] if len(r.passages) > passages else [*r.passages[1:], r.passages[0]]
            p = musique.prompt(tok, dataclasses.replace(r, passages=again))
            out.append(([list(c) for c in p.chunks()], list(p.question)))
    if len(out) < n:
        raise SystemExit(f"{len(records)} records give {len(out)} requests, fewer than {n}")
    return out[:n]


def retrieved(reqs: Sequence[Request]) -> list[bool]:
    """Which of a stream's requests are served as retrieved: every chunk of the request was in an
    earlier one (computed and stored back before it). In these streams the second of each
    example's (record's) two, and a second retrieval of a record at ten passages (its passages
    reordered; at fewer, it brings a passage no request stored)."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for chunks, _ in reqs:
        keys = [tuple(c) for c in chunks]
        out.append(all(k in seen for k in keys))
        seen.update(keys)
    return out


# -- the runs ------------------------------------------------------------------------


def reference(engine, reqs: Sequence[Request], progress: bool = True) -> tuple[list[int], list[float]]:  # noqa: ANN001
    """Full prefill's next token after every prompt, and its seconds."""
    import torch

    tokens, seconds = [], []
    with torch.no_grad():
        for chunks, question in _track(reqs, "reference (full prefill)", progress):
            tokens.append(_full(engine, chunks, question, seconds))
    return tokens, seconds


def _full(engine, chunks, question, seconds: list[float], memo: "ShadowMemo | None" = None,  # noqa: ANN001
          answer: Sequence[int] = ()) -> tuple[int, int, int]:
    """Full prefill's next token after the prompt, and teacher forcing over the served answer
    (its first ANSWER_TOKENS after the first): (token, answer tokens compared, agreeing)."""
    import torch

    tokens = [t for c in chunks for t in c] + list(question)
    answer = list(answer[:ANSWER_TOKENS + 1])
    fed = max(len(answer) - 1, 0)
    if memo is not None and (hit := memo.take(tokens, answer[:fed])) is not None:
        seconds.append(None)  # timed beside the store-back thread: not a clean full-prefill time
        picks = hit
    else:
        t0 = time.perf_counter()
        logits, _ = engine.prefill(torch.tensor(tokens + answer[:fed]), all_logits=False, last=fed + 1, kv=False)
        seconds.append(time.perf_counter() - t0)
        picks = logits.argmax(dim=-1).tolist()
    return picks[0], fed, sum(int(p == t) for p, t in zip(picks[1:], answer[1:]))


class ShadowMemo:
    """The next tokens of the full prefills the adapter's shadow thread ran (`prefill` of the
    shadows' model, `ShadowSampler.model`: the same computation on the same tokens as the
    reference's, the prompt, then the answer fed under teacher forcing): the reference of a
    sampled request is its shadow's own full prefill, not computed a second time. Keyed by
    the prompt's and the fed answer's tokens, so a shadow of other tokens (another order) is
    never taken for the reference."""

    def __init__(self, model) -> None:  # noqa: ANN001 - the shadows' model
        self._model = model
        self._prefill = model.prefill
        self._got: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
        self.hits = 0
        model.prefill = self  # the instance attribute hides the method, for this model only

    def __call__(self, tokens, *args, **kwargs):  # noqa: ANN001, ANN204
        import threading

        out = self._prefill(tokens, *args, **kwargs)
        if threading.current_thread().name.startswith("kvcraft-fidelity") and kwargs.get("all_logits") is False \
                and not args:
            tokens = [int(t) for t in tokens]
            cut = len(tokens) - (kwargs.get("last", 1) - 1)
            self._got[(tuple(tokens[:cut]), tuple(tokens[cut:]))] = out[0].argmax(dim=-1).tolist()
        return out

    def take(self, tokens: Sequence[int], fed: Sequence[int] = ()) -> list[int] | None:
        """The argmax after the prompt and after each fed answer token, if a shadow ran them."""
        hit = self._got.pop((tuple(tokens), tuple(fed)), None)
        self.hits += hit is not None
        return hit

    def close(self) -> None:
        del self._model.prefill  # the method again


def serve(engine, reqs: Sequence[Request], spec: str, ref: list[int] | None = None,  # noqa: ANN001
          ref_s: list[float] | None = None, progress: bool = True,
          new_tokens: int = 0, stop: Sequence[int] = (), state: Path | None = None,
          stop_after: int | None = None, near_tie: float | None = None) -> dict:
    """One run on a fresh service. spec: ADAPTIVE (the default adapter, shadows on; `near_tie`:
    its `RAGAdapter(near_tie=...)`) or a policy spec (shadows off). ref: full prefill's tokens;
    None: computed beside each request (appended to `ref` / `ref_s` lists returned in the
    result), with teacher forcing over the answer when `new_tokens` (each request decodes up to
    that many: `RAGAdapter.generate`).

    state: a folder that keeps the run's service data and the requests served so far
    (`Progress`): a run stopped there (after `stop_after` more requests, on SIGINT after the
    request in flight, or killed) goes on from the request after the last one saved, its
    service restarted on the same data, as a deployment restarts its service, with a new
    adapter (the engine's side starts afresh). Where the service's data is gone (the folder
    committed without it, on another machine), the service starts on the controller's tallies
    that the progress file kept at the last part's end, every chunk's KV to compute again, as a
    service whose disk was replaced. The result says where each part began ("parts"); it is
    partial (fewer requests than `reqs`) until the last part ends."""
    import torch

    from engine_adapter.fidelity import SamplingCost
    from engine_adapter.policy import parse_policy
    from engine_adapter.rag import RAGAdapter
    from kvclient.client import KVClient
    from kvservice.launcher import ServiceProcess

    layers = engine.cfg.num_layers
    flags = retrieved(reqs)
    own_ref = ref is None
    ref, ref_s = (list(ref) if ref is not None else []), (list(ref_s) if ref_s is not None else [])
    progress_file = Progress(state, spec, reqs, new_tokens, near_tie) if state is not None else None
    done = progress_file.load() if progress_file is not None else Progress.empty()
    rows: list[Served] = [Served(**r) for r in done["requests"]]
    if own_ref:
        ref, ref_s = done["reference"]["tokens"], done["reference"]["seconds"]
    first = len(rows)
    end = len(reqs) if stop_after is None else min(len(reqs), first + stop_after)
    part = {"first_request": first, "commit": results.commit(),  # the code this part starts with
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    shadow_hits = done["reference"].get("from_shadows", 0)
    if progress_file is not None and rows and not (state / "data" / "metadata").exists():
        progress_file.seed(state / "data")
        part["service_data"] = "tallies"  # the data dir was gone: the tallies alone, no chunk's KV
    t_run = time.perf_counter()
    with torch.no_grad(), tempfile.TemporaryDirectory(prefix="kvcraft-fidelity-") as tmp, \
            ServiceProcess((state or Path(tmp)) / "data") as service, KVClient(service.address) as client, \
            contextlib.ExitStack() as closing, StopOnInterrupt(state is not None) as interrupt:
        memo = None
        if spec == ADAPTIVE:
            adapter = RAGAdapter(engine, client, near_tie=near_tie)
            memo = ShadowMemo(adapter.fidelity.model) if own_ref else None
        else:
            adapter = RAGAdapter(engine, client, parse_policy(spec), shadows=False)

        def hits() -> int:  # references taken from shadows, every part's
            return shadow_hits + (memo.hits if memo else 0)

        closing.callback(adapter.close)  # (an interrupted run too: its shadow thread, the engine's prefill)
        if memo is not None:
            closing.callback(memo.close)
        for i, (chunks, question) in enumerate(_track(reqs[first:end], spec, progress), start=first):
            answer: Sequence[int] = ()
            if new_tokens:
                gen, result, report = adapter.generate(chunks, question, new_tokens, stop, reorder=False)
                answer = gen.tokens
            else:
                result, report = adapter.prefill(chunks, question, reorder=False)
            adapter.flush()  # store-back and the shadow: the next Plan sees both (not in TTFT)
            compared = agreeing = 0
            if own_ref:
                token, compared, agreeing = _full(engine, chunks, question, ref_s, memo, answer)
                ref.append(token)
            share = report.computed_rows / (report.prompt_tokens * layers) if result.computed_rows else 1.0
            rows.append(Served(budget=report.budget, blended=report.reused_chunks > 0 and not report.blend_skipped,
                               sampled=report.sampled,
                               agree=int(result.logits.argmax()) == ref[i], share=share, ttft_s=report.ttft_s,
                               prompt_tokens=report.prompt_tokens, fallbacks=len(report.fallbacks),
                               plan_failed=bool(report.plan_error),
                               as_retrieved=flags[i],
                               answer_tokens=compared, answer_agree=agreeing, near_tie=report.near_tie,
                               blend_skipped=report.blend_skipped))
            if progress_file is not None:  # this part as far as it went: a kill loses the request in flight alone
                part.update(last_request=i, seconds=time.perf_counter() - t_run,
                            sampling_cost=asdict(adapter.sampling_cost()))
                progress_file.save(rows, ref, ref_s, hits(), [*done["parts"], part])
            if interrupt.asked:
                break
        stats = client.stats()
        cost = adapter.sampling_cost()
    part.update(last_request=len(rows) - 1, seconds=time.perf_counter() - t_run, sampling_cost=asdict(cost))
    parts = [*done["parts"], part] if end > first or not done["parts"] else done["parts"]  # (run again once done)
    if progress_file is not None:
        progress_file.keep_tallies(state / "data")  # the service has stopped: its tallies as it wrote them
        progress_file.save(rows, ref, ref_s, hits(), parts)
    total = {k: sum(p["sampling_cost"][k] for p in parts) for k in asdict(cost)}
    out = {"policy": spec, "commit": parts[0]["commit"], "seconds": sum(p["seconds"] for p in parts),
           "requests": [asdict(r) for r in rows],
           "service": fidelity_record(stats),
           "sampling_cost": {**total, "row_share": SamplingCost(**total).row_share}}
    if len(parts) > 1:
        out["parts"] = [{k: v for k, v in p.items() if k != "sampling_cost"} for p in parts]
    if own_ref:
        out["reference"] = {"tokens": ref, "seconds": ref_s, "from_shadows": hits()}
    return out


class StopOnInterrupt(contextlib.AbstractContextManager):
    """With `on` (a run that can go on), the first SIGINT (Ctrl-C) asks the run to stop once the
    request in flight is served and saved (`asked`); a second one interrupts at once."""

    def __init__(self, on: bool) -> None:
        import threading

        self.asked = False
        self._on = on and threading.current_thread() is threading.main_thread()
        self._before = None

    def __enter__(self) -> "StopOnInterrupt":
        import signal

        if self._on:
            self._before = signal.signal(signal.SIGINT, self._ask)
        return self

    def _ask(self, signum, frame) -> None:  # noqa: ANN001
        if self.asked:
            raise KeyboardInterrupt
        self.asked = True
        print("stopping once the request in flight is saved (Ctrl-C again: at once)", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:  # noqa: ANN002
        import signal

        if self._before is not None:
            signal.signal(signal.SIGINT, self._before)


class Progress:
    """A run's requests served so far, in `state`/progress.json (written after every request,
    replaced whole), the parts it ran in, and the service's fidelity tallies as the last part
    left them (`keep_tallies`; `seed` starts a service from them where its data is gone).
    Refuses a folder another stream or run left."""

    def __init__(self, state: Path, spec: str, reqs: Sequence[Request], new_tokens: int,
                 near_tie: float | None) -> None:
        self.path = Path(state) / "progress.json"
        tokens = hashlib.sha256(json.dumps(reqs).encode()).hexdigest()[:16]  # the stream itself: data, seed, layout
        self.key = {"policy": spec, "near_tie": near_tie, "requests": len(reqs), "new_tokens": new_tokens,
                    "tokens_sha256": tokens}
        self.tallies: list[dict] = []
        self.path.parent.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def empty() -> dict:
        return {"requests": [], "reference": {"tokens": [], "seconds": [], "from_shadows": 0}, "parts": []}

    def load(self) -> dict:
        if not self.path.exists():
            if (self.path.parent / "data").exists():
                raise SystemExit(f"{self.path.parent}: service data without {self.path.name}: not a run to go on with")
            self.save([], [], [], 0, [])  # before the service makes its data here
            return self.empty()
        saved = json.loads(self.path.read_text())
        if saved["stream"] != self.key:
            raise SystemExit(f"{self.path} holds another run ({saved['stream']}), not {self.key}")
        self.tallies = saved.get("tallies", [])
        return saved

    def keep_tallies(self, data: Path) -> None:
        """The fidelity tallies in the stopped service's data dir `data`."""
        from kvservice.metadata import MetadataDB

        db = MetadataDB(data / "metadata")
        try:
            self.tallies = [asdict(t) for t in db.load_fidelity()]
        finally:
            db.close()

    def seed(self, data: Path) -> None:
        """A new data dir `data` holding the kept tallies alone."""
        from kvservice.fidelity import Tally
        from kvservice.metadata import MetadataDB

        if not self.tallies:
            raise SystemExit(f"{self.path.parent}: requests served but neither the service's data ({data}) nor "
                             "its tallies: the run cannot go on as it was; start again in a new folder")
        db = MetadataDB(data / "metadata")
        try:
            db.put_fidelity([Tally(**t) for t in self.tallies])
        finally:
            db.close()

    def save(self, rows: Sequence[Served], ref: list, ref_s: list, shadow_hits: int, parts: list) -> None:
        """The requests served, their references, and the parts that served them."""
        body = {"stream": self.key, "requests": [asdict(r) for r in rows],
                "reference": {"tokens": ref, "seconds": ref_s, "from_shadows": shadow_hits}, "parts": parts,
                "tallies": self.tallies}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body))
        tmp.replace(self.path)


def _track(items, description: str, progress: bool):  # noqa: ANN001, ANN202
    if not progress:
        return items
    from rich.console import Console
    from rich.progress import track

    return track(items, description=description, console=Console(stderr=True))


def default_sweep(task: str) -> list[str]:
    blend = "cacheblend:ratio=0.15" if task in ("short", "long") else "cacheblend:budget=0.15"
    return [f"query:budget={b:g}" for b in LADDER if b < 1] + ["naive", blend]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    p = argparse.ArgumentParser(prog="kvcraft bench fidelity-stream", description=__doc__.split("\n")[0])
    p.add_argument("--task", choices=TASKS, default="short")
    p.add_argument("--requests", type=count(), default=300, help="requests in the stream (N)")
    p.add_argument("--seed", type=count(0), default=1, help="held-out draw (synthetic) / shuffle seed (musique)")
    p.add_argument("--data", type=Path, help="musique: CacheBlend's musique_s.json (held-out records 0-119)")
    p.add_argument("--first", type=count(0), default=0, help="musique: first record")
    p.add_argument("--records", type=count(), default=120, help="musique: records (held-out: 0-119)")
    p.add_argument("--passages", type=count(), default=3)
    p.add_argument("--neighbours", type=count(0), default=1, help="musique: passages of the next record in request 1")
    p.add_argument("--model-dir", help="musique: the model folder (default: as `kvcraft model fetch`)")
    p.add_argument("--sweep", nargs="*", help="fixed policies (default: query at each ladder budget < 1, naive, "
                                              "cacheblend); `none`: no sweep")
    p.add_argument("--sweep-requests", type=count(), help="serve the sweep's policies the stream's first M requests "
                                                       "alone (default: all)")
    p.add_argument("--new-tokens", type=count(0), default=0,
                   help="every run decodes each answer (greedy, up to N tokens) and compares its first "
                        f"{ANSWER_TOKENS} after the first under teacher forcing; 0: first tokens alone")
    p.add_argument("--threads", type=count(), default=2)
    p.add_argument("--near-tie", type=float, metavar="LOGITS", help="the adaptive run's near-tie margin: it serves "
                   "by full prefill a blended request whose first token leads the runner-up by less "
                   "(`engine_adapter.near_tie`; default: the margin the service learns; 0: none)")
    results.add_argument(p, "fidelity-stream")
    p.add_argument("--resume", type=Path, help="a result JSON of the same stream: its adaptive run and reference are "
                                               "kept, and its sweep runs; only the --sweep policies it lacks run")
    p.add_argument("--state", type=Path, help="a folder for the adaptive run's service data and the requests it "
                                              "served: a run stopped or killed goes on from there when the same "
                                              "command runs again, its service restarted on the same data")
    p.add_argument("--stop-after", type=count(), help="with --state: stop the adaptive run after serving this many "
                                                  "more requests (the results file is written once all are served)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    a = p.parse_args(argv)
    if a.stop_after is not None and a.state is None:
        p.error("--stop-after needs --state (where the run goes on from)")
    if a.near_tie is not None and not a.near_tie >= 0:
        p.error(f"--near-tie must be a margin >= 0 logits, got {a.near_tie}")
    a.argv = argv
    import torch

    from engine_adapter import LlamaEngine, stop_tokens
    from engine_adapter.fidelity import ANSWER_TOKENS as SHADOW_ANSWER_TOKENS
    from engine_adapter.policy import parse_policy
    assert SHADOW_ANSWER_TOKENS == ANSWER_TOKENS, "engine_adapter.fidelity changed"
    torch.set_num_threads(a.threads)
    sweep = default_sweep(a.task) if a.sweep is None else [] if a.sweep == ["none"] else a.sweep
    for spec in sweep:
        parse_policy(spec)
    if a.task == "musique":
        from transformers import AutoTokenizer

        from kvbench.common import musique
        from kvbench.common.realmodel import fetch

        if a.data is None:
            p.error("--task musique needs --data musique_s.json (records 0-119 are the held-out split)")
        model_dir = fetch(a.model_dir).path
        records = musique.load(a.data, passages=a.passages + 1)[a.first:a.first + a.records]
        reqs = musique_stream(AutoTokenizer.from_pretrained(model_dir), records, a.requests, a.seed, a.neighbours,
                              a.passages)
    else:
        from kvbench.quality.deployed import TASKS as SYNTH

        model_dir = SYNTH[a.task][1]
        reqs = synthetic_stream(a.task, a.requests, a.seed)
    engine = LlamaEngine.from_pretrained(model_dir)
    progress = not a.quiet
    commands, runs, first_date, ran_on = [], [], None, None
    if a.resume:
        old = json.loads(a.resume.read_text())
        ran_on = old["machine"]  # its runs' machine, until this one serves a run
        prior = [{**r, "requests": unpack(r["requests"])} for r in old["runs"]]
        adaptive, runs = prior[0], prior[1:]
        commands = old["meta"]["commands"]
        first_date = old["meta"]["first_date"]
        if len(adaptive["requests"]) != len(reqs) or old["meta"]["task"] != a.task:
            p.error(f"{a.resume} is another stream ({old['meta']['task']}, {len(adaptive['requests'])} requests)")
    else:
        adaptive = serve(engine, reqs, ADAPTIVE, progress=progress, new_tokens=a.new_tokens,
                         stop=sorted(stop_tokens(model_dir)), state=a.state, stop_after=a.stop_after,
                         near_tie=a.near_tie)
        if len(adaptive["requests"]) < len(reqs):
            print(f"adaptive: {len(adaptive['requests'])} of {len(reqs)} requests served, kept in {a.state}; "
                  "the same command goes on from there")
            return 0
        write(a, adaptive, runs, adaptive["reference"]["seconds"], reqs, commands, model_dir, first_date)
    ref, ref_s = adaptive["reference"]["tokens"], adaptive["reference"]["seconds"]
    have = {r["policy"] for r in runs}
    m = a.sweep_requests or len(reqs)
    for spec in sweep:
        if spec not in have:
            if a.new_tokens:  # each policy's own answers, compared under teacher forcing: a reference of its own
                run = serve(engine, reqs[:m], spec, progress=progress,
                            new_tokens=a.new_tokens, stop=sorted(stop_tokens(model_dir)))
            else:
                run = serve(engine, reqs[:m], spec, ref[:m], ref_s[:m], progress=progress)
            runs.append(run)
            ran_on = None
            write(a, adaptive, runs, ref_s, reqs, commands, model_dir, first_date)  # each run saved as it ends
    write(a, adaptive, runs, ref_s, reqs, commands, model_dir, first_date, show=True, ran_on=ran_on)
    return 0


def write(a: argparse.Namespace, adaptive: dict, runs: list[dict], ref_s: list, reqs: Sequence[Request],
          commands: list[str], model_dir: Path | str, first_date: str | None = None, show: bool = False,
          ran_on: dict | None = None) -> None:
    """The results file (`kvbench.results`): the report, every run's requests, and `meta`: the
    stream's settings and, for a file a resumed run added to, each command that wrote it. `ran_on`:
    the machine of a resumed file's runs, where this one served none (`results.save`)."""
    import torch

    from engine_adapter.policy import DEFAULT_POLICY, parse_policy

    rep = report(adaptive, runs, parse_policy(DEFAULT_POLICY).name, ref_s)
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    meta = {"task": a.task, "model": Path(model_dir).name, "requests": a.requests, "seed": a.seed,
            **({"passages": a.passages} if a.task == "musique" else {}), "threads": a.threads,
            "near_tie": "learned" if a.near_tie is None else a.near_tie,
            "torch_threads": torch.get_num_threads(), "first_date": first_date or now,
            "commands": [*commands, f"{now}: {results.command('fidelity-stream', a.argv)}"],
            "prompt_tokens_mean": mean([len(q) + sum(map(len, c)) for c, q in reqs]),
            "run_seconds": {r["policy"]: r["seconds"] for r in [adaptive, *runs]}}
    if show:
        print_report(rep, f"{a.task}: {len(reqs)} requests, seed {a.seed}")
    results.save("fidelity-stream", a.argv, {"meta": meta, "report": rep, "runs": [adaptive, *runs]}, a.json,
                 dumps=dumps, ran_on=ran_on)


def columns(rows: Sequence[dict]) -> dict:
    """Per-request rows as one list per field (booleans as 0/1, floats rounded): compact JSON."""
    def cell(v):  # noqa: ANN001, ANN202
        return int(v) if isinstance(v, bool) else round(v, 5) if isinstance(v, float) else v

    return {k: [cell(r[k]) for r in rows] for k in (rows[0] if rows else {})}


def unpack(cols: dict) -> list[dict]:
    """`columns` back to rows."""
    keys = list(cols)
    return [dict(zip(keys, vals)) for vals in zip(*(cols[k] for k in keys))] if keys else []


def dumps(result: dict) -> str:
    """The result as JSON: the report indented, each run's per-request columns one line each."""
    runs = []
    for r in result["runs"]:
        r = {**r, "requests": columns(r["requests"])}
        if "reference" in r:
            r["reference"] = {"tokens": r["reference"]["tokens"],
                              "seconds": [None if x is None else round(x, 5) for x in r["reference"]["seconds"]],
                              "from_shadows": r["reference"].get("from_shadows", 0)}
        runs.append(r)
    text = json.dumps({**result, "runs": "@RUNS@"}, indent=1)
    body = ",\n".join("  " + json.dumps(r, separators=(",", ":")) for r in runs)
    return text.replace('"@RUNS@"', "[\n" + body + "\n ]") + "\n"


if __name__ == "__main__":
    sys.exit(main())

