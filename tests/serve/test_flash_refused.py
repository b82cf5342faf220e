"""The serving engine refuses GLM-5.3-Flash's recurrent (KDA) layers by name."""
import pytest

from glm5_jax.hf.config import config_from_hf
from hf_reference_flash import TEXT


def test_the_serving_engine_refuses_recurrent_layers_by_name():
    """Its prefix cache rewinds slots to a shared prefix; a KDA state cannot be rewound."""
    from glm5_jax.serve.engine import Engine

    with pytest.raises(ValueError, match="KDA"):
        Engine(config_from_hf({**TEXT, "model_type": "glm5_next"}), variables=None)
