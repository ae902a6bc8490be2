"""A request's blend on the scheduler side: the chunk boundaries, policy and options it
asked for in kv_transfer_params["kvcraft"] (docs/vllm.md "Blending"), and what came of it."""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from engine_adapter.cost import worth_blending
from engine_adapter.prompt import Layout, Segment, planned_chunks
from engine_adapter.vllm.config import ConnectorSettings, make_blend_policy
from engine_adapter.vllm.lookup import Breaker
from engine_adapter.vllm.metrics import ConnectorMetrics
from kvclient.errors import DeadlineExceededError
from kvcraft.keys import chunk_key
from kvcraft.plans import Plan

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger("kvcraft.vllm")


@dataclass
class Blend:
    """One request's blend: its chunks, policy, Plan and what came of it."""

    chunk_tokens: tuple[int, ...]
    policy: str
    options: tuple[tuple[str, Any], ...]
    future: Any = None
    deadline: float = 0.0
    plan: Plan | None = None           # a usable Plan (the BlendLoad carries it to the worker side)
    reused_chunks: int = 0
    declined: str = ""                 # why kvcraft does not build this request's context
    claimed: int = 0                   # tokens vLLM accepted from the blend (last admission)
    result: dict[str, Any] | None = None  # RequestOutput.kv_transfer_params["kvcraft"]
    plan_s: float | None = None        # Plan RPC sent -> answered (or failed)
    lease_id: str = ""                 # the Plan's lease, until a blend load takes it over
    budget: float = 0.0                # the Plan's recompute budget (adaptive: the fidelity controller's)
    last_ready: bool = False           # the worker side holds the last blend's last token (`last_token`)

    @property
    def adaptive(self) -> bool:
        """The default policy without options: it spends the recompute budget the service's
        fidelity controller gives (docs/quality.md), as RAGAdapter(policy=None) does."""
        return is_adaptive(self.policy, self.options)

    def release(self, client: Any) -> None:
        """Free the Plan's lease unless a blend load took it (the worker side releases that one)."""
        if self.lease_id and not self.claimed:
            try:
                client.release_future(self.lease_id)
            except Exception:  # noqa: BLE001 - the lease expires by its TTL
                pass
        self.lease_id = ""

    def ask_plan(self, tokens: list[int], client: Any, chunk_model_id: str, settings: ConnectorSettings,
                 metrics: ConnectorMetrics, breaker: Breaker, on_done: Callable[[], None] | None = None,
                 take_timings: Callable[[], bytes] = bytes) -> bool | None:
        """Ask the service for the chunks' Plan (a future, never waited on): None while
        pending, False when the blend is off for this request (self.declined says why).
        on_done is called (on one of the client's threads) when the Plan is answered or fails;
        take_timings gives the finished blends' timings (a serialized TimingReport, or b"")
        that the Plan carries to the service's loading controller."""
        from kvcraft.v1 import kvcraft_pb2 as pb

        now = time.monotonic()
        chunks, at = [], 0
        for n in self.chunk_tokens:
            chunks.append(tokens[at:at + n])
            at += n
        if self.future is None:
            if breaker.is_off():
                metrics.add(lookups_skipped=1)
                self.declined = "the service is switched off after failures"
                return False
            metrics.add(blend_plans=1)
            self.deadline = now + settings.plan_timeout_s
            sent = time.perf_counter()
            try:
                report = take_timings()
                timings = pb.TimingReport.FromString(report) if report else None
                self.future = client.plan_future(chunk_model_id, chunks, len(tokens) - at, first_turn=False,
                                                 timings=timings, timeout=settings.plan_timeout_s,
                                                 policy=self.policy, adaptive=self.adaptive)
                if timings is not None:
                    metrics.add(blend_timing_reports=1)
                def answered(_f: Any) -> None:
                    self.plan_s = time.perf_counter() - sent
                    if on_done is not None:
                        on_done()

                self.future.add_done_callback(answered)
            except Exception as e:  # noqa: BLE001 - vLLM computes the request alone
                metrics.add(blend_plan_errors=1)
                breaker.failed("error", f"{type(e).__name__}: {e}")
                self.declined = f"Plan could not be sent ({type(e).__name__})"
                return False
        if not self.future.done():
            if now < self.deadline:
                return None
            self.future.cancel()
            metrics.add(blend_plan_timeouts=1)
            breaker.failed("timeout", f"no Plan within {settings.plan_timeout_s:.2f}s")
            self.declined = f"no Plan within plan_timeout_s={settings.plan_timeout_s}"
            return False
        try:
            plan = self.future.result()
        except Exception as e:  # noqa: BLE001 - timeouts, errors, cancellation: vLLM alone
            timeout = isinstance(e, DeadlineExceededError)
            metrics.add(**{"blend_plan_timeouts" if timeout else "blend_plan_errors": 1})
            breaker.failed("timeout" if timeout else "error", str(e))
            self.declined = f"Plan failed ({type(e).__name__})"
            return False
        breaker.failures = 0
        self.lease_id = plan.lease_id
        self.budget = plan.recompute_budget
        if self.adaptive and plan.recompute_budget >= 1:
            self.declined = ("the fidelity controller serves this model by exact reuse only: vLLM alone, with its "
                             "prefix cache (docs/fidelity.md)")
            self.release(client)
            return False
        keys = [chunk_key(chunk_model_id, c) for c in chunks]
        if list(plan.order) != keys or plan.dropped:
            self.declined = "the Plan changed the chunk order or dropped chunks (duplicates in the prompt?)"
            metrics.add(blend_declined=1)
            self.release(client)
            return False
        self.reused_chunks = sum(1 for cp in plan.chunks if cp.reused)
        # The prompt as the worker side's RAGAdapter lays it out, for the cost gate's one reading of it.
        segments = planned_chunks(plan, dict(zip(keys, chunks)))
        question = [Segment(tokens[at:], question=True)] if len(tokens) > at else []
        if self.adaptive and not worth_blending(Layout.of(segments + question, chunk_model_id), plan.recompute_budget):
            self.declined = ("too little of it is stored for a blend to beat vLLM alone, with its prefix cache "
                             "(docs/fidelity.md, \"Blend only where it pays\")")
            self.release(client)
            return False
        self.plan = plan
        return True


PARAM_KEYS = ("chunks", "policy", "options")
# vLLM's completions server names prompt i of a request "cmpl-<id>-<i>", and its engine
# appends 8 random hex digits (OpenAIServingCompletion._create_completion,
# InputProcessor.assign_request_id).
_COMPLETION_PROMPT = re.compile(r"^cmpl-.+-(\d+)-[0-9a-f]{8}$")


@dataclass(frozen=True)
class BlendAsk:
    """kv_transfer_params["kvcraft"] once checked: what one prompt asks for."""

    chunks: tuple[int, ...]
    policy: str | None        # None: the connector's blend_policy
    options: dict | None      # None: blend_options (with the connector's policy) or {}


def check_ask(ask: Any, prompt_tokens: int | None = None) -> BlendAsk:
    """kv_transfer_params["kvcraft"] checked as far as it can be without the connector's
    settings; ValueError naming the problem. prompt_tokens: the prompt's length when known
    (the connector always knows it; vLLM's HTTP server only for token-id prompts)."""
    if not isinstance(ask, dict):
        raise ValueError(f"a mapping is needed (keys {', '.join(PARAM_KEYS)}), got {type(ask).__name__}")
    unknown = set(ask) - set(PARAM_KEYS)
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}; known: {', '.join(PARAM_KEYS)}")
    chunks = ask.get("chunks")
    if (not isinstance(chunks, (list, tuple)) or not chunks
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in chunks)):
        raise ValueError(f"chunks must be a non-empty list of token counts > 0, got {chunks!r}")
    if prompt_tokens is not None and sum(chunks) >= prompt_tokens:
        raise ValueError(f"chunks cover {sum(chunks)} tokens of a {prompt_tokens}-token prompt; "
                         "the question needs at least one")
    policy = ask.get("policy")
    options = ask.get("options")
    if policy is not None:
        make_blend_policy(policy, {} if options is None else options)
    elif options is not None and not isinstance(options, dict):
        raise ValueError(f"options must be a mapping, got {type(options).__name__}")
    return BlendAsk(tuple(chunks), policy, options)


def prompt_index(request_id: str) -> int:
    """The prompt's place in a completions request of several prompts (0 for any other)."""
    m = _COMPLETION_PROMPT.match(request_id)
    return int(m.group(1)) if m else 0


def parse_blend(request: "Request", tokens: list[int], settings: ConnectorSettings,
                metrics: ConnectorMetrics) -> Blend | None:
    """The request's blend, if it carries kv_transfer_params {"kvcraft": {"chunks": [...]}}.
    Bad parameters are logged, counted (`blend_bad_params`) and named in the report's
    `fallback`; the request is served by vLLM alone.

    Boundaries describe one prompt: the second and later prompts of a completions request
    of several (vLLM hands each the same kv_transfer_params) are served by vLLM alone."""
    params = getattr(request, "kv_transfer_params", None)
    ask = params.get("kvcraft") if isinstance(params, dict) else None
    if ask is None:
        return None
    try:
        checked = check_ask(ask, len(tokens))
        if prompt_index(request.request_id):
            raise ValueError(f"this is prompt {prompt_index(request.request_id)} of a request of several; "
                             "kvcraft.chunks describe one prompt: send one request per prompt")
        name = checked.policy or settings.blend_policy
        if checked.options is not None:
            options = checked.options
        else:
            options = settings.blend_options if checked.policy is None else {}
        if settings.blend_policy != "off":
            make_blend_policy(name, options)
    except ValueError as e:
        log.warning("kvcraft: request %s: bad kv_transfer_params['kvcraft'] (%s); vLLM computes it alone",
                    request.request_id, e)
        metrics.add(blend_bad_params=1)
        return Blend((), _policy_named(ask, settings), (), declined=f"bad kv_transfer_params: {e}")
    if settings.blend_policy == "off":
        return Blend(checked.chunks, name, (), declined="blending is off (blend_policy)")
    return Blend(checked.chunks, name, tuple(sorted(options.items())))


def computed_share(report: dict[str, Any]) -> float:
    """A blended request's report's `computed_share`: kvcraft's row-layers in tokens, plus the
    tokens vLLM computed, over the prompt (docs/vllm.md's report table)."""
    kvcraft_tokens = report["kvcraft_row_layers"] / report["num_layers"]
    return (kvcraft_tokens + report["vllm_computed_tokens"]) / report["prompt_tokens"]


def is_adaptive(policy: str, options: Any) -> bool:
    """A blend by kvcraft's default policy without options (`Blend.adaptive`)."""
    from engine_adapter.policy import DEFAULT_POLICY

    return policy == DEFAULT_POLICY and not options


def _policy_named(ask: Any, settings: ConnectorSettings) -> str:
    """The policy a request named, for its report (its parameters may be bad)."""
    name = ask.get("policy") if isinstance(ask, dict) else None
    return name if isinstance(name, str) else settings.blend_policy
