"""The INT4 recipe demo's language model (bench/int4_qat.py --task=lm): configs/tiny.py with every FFN a routed
MoE (no dense first layer, no shared expert), so INT4 touches every feed-forward weight the model has, trained on
the embedded corpus (the Python standard library's source). 8 experts top-2 of width 128 on a 128-wide model:
the packer needs 8 x group_size | 128, so groups of 16 input channels."""
import dataclasses

from configs.tiny import get_config as tiny_config


def get_config():
    exp = tiny_config()
    model = exp.model.replace(first_k_dense_replace=0, n_shared_experts=0)
    train = dataclasses.replace(exp.train, steps=400, eval_every=100, eval_batches=16, checkpoint_every=100)
    return dataclasses.replace(exp, model=model, train=train)
