"""schemathesis over the served OpenAPI document of /v1/magic (GET /v1/magic/openapi.json).

Every operation gets a small, derandomized batch of generated requests (hypothesis
``max_examples`` below) against the plugin served over real HTTP, as an admin for the operator
routes and as the bound agent client for the agent-host protocol. No answer may be a server
error (5xx), carry a traceback, or leak a secret: the webhook token of an applied queue or the
server's JWT signing key.
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402

from conftest import MAGIC_YAML, MagicStack, seed  # noqa: E402
from testflinger_magic import db as tfdb  # noqa: E402
from testflinger_magic.server import auth  # noqa: E402

#: Generated requests per operation (kept small: the suite's normal run includes this).
EXAMPLES = 10
SECRET = "W3bh00k-T0ken-9f2c"
HOOK = f"https://chat.example.com/hooks/{SECRET}"
AGENT_PATHS = ("/v1/magic/agent-hosts/{host}", "/v1/magic/agent-hosts/{host}/work",
               "/v1/magic/agent-hosts/{host}/heartbeat", "/v1/magic/leases/{lease_id}/report")


@pytest.fixture(scope="module")
def stack():
    from conftest import Served

    served = []

    def serve(app):
        s = Served(app)
        served.append(s)
        return s

    database = tfdb.connect()
    seed(database)
    m = MagicStack(database, serve, yaml_text=MAGIC_YAML + f"      notify: ['{HOOK}']\n")
    m.plugin.kick = lambda *a, **k: None
    m.agent = {"Authorization": "Bearer " + auth.issue_token(
        m.app.config["JWT_SIGNING_KEY"], "fuzz-host-client", "agent")}
    yield m
    m.plugin.stop()
    for s in served:
        s.close()


@pytest.fixture(scope="module")
def operations(stack):
    """``{(METHOD, path): schemathesis APIOperation}`` from the served document."""
    loaded = schemathesis.openapi.from_url(f"{stack.url}/v1/magic/openapi.json")
    ops = (r.ok() for r in loaded.get_all_operations())
    return {(op.method.upper(), op.path): op for op in ops}


def _document_operations():
    from testflinger_magic.server import api, status_page  # noqa: F401 (adds its route)

    # schemathesis leaves out the operation serving the document it loaded (the document's
    # own URL); test_the_served_document_lists_every_magic_route covers that route.
    return sorted((method.upper(), path) for path, item in api.build_openapi()["paths"].items()
                  for method in item if path != "/v1/magic/openapi.json")


def test_the_served_document_lists_every_magic_route(stack):
    import requests

    doc = requests.get(f"{stack.url}/v1/magic/openapi.json", timeout=10).json()
    routes = {rule.rule.replace("<", "{").replace(">", "}")
              for rule in stack.app.url_map.iter_rules() if rule.rule.startswith("/v1/magic")}
    assert set(doc["paths"]) == routes
    report = doc["paths"]["/v1/magic/leases/{lease_id}/report"]["post"]
    assert report["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ReportIn")


@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize("route", _document_operations(), ids=" ".join)
def test_fuzz_magic_api(stack, operations, route, mode):
    from hypothesis import given

    from schemathesis.generation import GenerationMode

    operation = operations[route]
    headers = stack.agent if route[1] in AGENT_PATHS else stack.headers("admin")
    seen = []

    @given(case=operation.as_strategy(GenerationMode(mode)))
    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case):
        if route[1] == "/v1/magic/agent-hosts/{host}/work":
            case.query = {}  # the long-poll's wait is not fuzzed (it would only be slow)
        response = case.call(base_url=stack.url, headers=headers, timeout=30)
        seen.append(response.status_code)
        text = response.text
        where = f"{route[0]} {case.formatted_path}: {response.status_code}"
        assert response.status_code < 500, f"{where}: {text[:500]}"
        assert "Traceback" not in text, where
        assert SECRET not in text, where
        assert stack.app.config["JWT_SIGNING_KEY"] not in text, where

    try:
        run()
    except Unsatisfiable:
        # Negative mode needs something to make invalid: an operation without a body has at
        # most free-text path parameters, so no invalid request exists.
        assert mode == "negative" and not operation.definition.raw.get("requestBody"), route
        return
    assert seen, "no request was generated"
