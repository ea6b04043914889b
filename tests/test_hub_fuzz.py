"""Fuzzing the hub from its own OpenAPI schema (schemathesis's strategies under hypothesis):
generated requests, valid ones and deliberately invalid ones, with a device's and an owner's
token, against a real server on 127.0.0.1. No answer may be a 500, and the state must stay
readable. Bounded: a few hundred requests per token."""

import pytest
import requests
import schemathesis
from hubutil import HubProcess
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from gbray.hub.store import Store

EXAMPLES = 300


@pytest.fixture(scope="module")
def hub(tmp_path_factory, corpus):
    root = tmp_path_factory.mktemp("fuzz")
    h = HubProcess(root, "--size-limit-mb", "8")
    Store(h.db).load(corpus / "train.jsonl", corpus / "eval.jsonl")
    h.start()
    yield h
    h.stop()


def every_request(hub):
    """One strategy for every operation of the hub's schema, valid and invalid data alike."""
    schema = schemathesis.openapi.from_url(hub.url + "/openapi.json")
    strategies = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategies.append(operation.as_strategy(generation_mode=mode))
    assert len(strategies) >= 20
    return st.one_of(strategies)


@pytest.mark.parametrize("who", ["device", "owner"])
def test_no_generated_request_makes_a_500(hub, who):
    seen = []

    @given(case=every_request(hub))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    def run(case):
        response = case.call(base_url=hub.url, headers=hub.headers(who), timeout=30)
        seen.append(response.status_code)
        assert response.status_code < 500, (
            case.method,
            case.formatted_path,
            case.query,
            case.body,
            response.text[:300],
        )

    run()
    assert len(seen) >= EXAMPLES // 2
    assert any(code < 300 for code in seen) and any(400 <= code < 500 for code in seen)


def test_the_state_is_readable_after_the_fuzzing(hub):
    headers = hub.headers("owner")
    for path in ("/v1/training/state", "/v1/training/serving"):
        r = requests.get(hub.url + path, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
    rounds = requests.get(hub.url + "/v1/training/state", headers=headers, timeout=30).json()
    assert rounds["rounds"], "the fuzzing registered no round at all"
    for r in rounds["rounds"][:20]:
        detail = requests.get(
            f"{hub.url}/v1/training/rounds/{r['id']}", headers=headers, timeout=30
        )
        assert detail.status_code == 200, detail.text
