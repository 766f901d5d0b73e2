"""The router gets the replicas' tokenizer: the model volume mounted read-only and
`kvfleet router --tokenizer` pointing at the model folder, or neither when turned off."""

from __future__ import annotations

from tests.chart.conftest import Render, kvfleet_cli_params
from tests.chart.test_render import CI_DIGEST, DEFAULT, _container, _env, _mount, _volume


def test_router_reads_the_tokenizer_from_the_model_folder(render: Render) -> None:
    obj = render(DEFAULT).get("Deployment", "kvfleet-router")
    c = _container(obj, "router")
    params = kvfleet_cli_params(c["args"])
    # The same folder the replicas serve; Kubernetes expands the digest from the env.
    assert str(params["tokenizer"]) == "/models/$(KVFLEET_WEIGHTS_DIGEST)"
    assert _env(c)["KVFLEET_WEIGHTS_DIGEST"] == CI_DIGEST
    assert _mount(c, "model") == {"name": "model", "mountPath": "/models", "readOnly": True}
    assert _volume(obj, "model")["persistentVolumeClaim"] == {
        "claimName": "llama-weights", "readOnly": True,
    }


def test_router_without_the_tokenizer(render: Render) -> None:
    obj = render(DEFAULT, set=["router.tokenizer.fromModelVolume=false"]).get(
        "Deployment", "kvfleet-router")
    c = _container(obj, "router")
    assert kvfleet_cli_params(c["args"])["tokenizer"] is None
    assert "KVFLEET_WEIGHTS_DIGEST" not in _env(c)
    assert all(v["name"] != "model" for v in obj["spec"]["template"]["spec"]["volumes"])
