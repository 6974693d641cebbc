"""The all-models development key: only for a gateway that runs its own models, or when asked for."""

from __future__ import annotations

import dataclasses

from server.config import load_config
from server.domain_models import Deployment, ProviderSpec, UpstreamSpec
from server.serving import wants_development_key


def test_the_embedded_default_configuration_gets_one():
    assert wants_development_key(load_config(), asked=False)


def test_never_unasked_in_front_of_upstreams():
    config = load_config()
    upstream = ProviderSpec("openai", UpstreamSpec(base_url="http://127.0.0.1:1/v1", model="m"))
    embedded = config.models[0].deployments[0]  # an upstream beside the embedded model is enough
    deployments = (embedded, Deployment("upstream", upstream))
    models = (dataclasses.replace(config.models[0], deployments=deployments), *config.models[1:])
    config = dataclasses.replace(config, models=models)
    assert not wants_development_key(config, asked=False)
    assert wants_development_key(config, asked=True)
