"""A stage loads only its slice: its blocks, plus the embedding (first) or the head (last)."""
import pytest

from worker.models import open_worker, tinygrad_model
from worker.partition import Shard, layer_range
from worker.weights.contract import block_tensor_names
from worker.weights.tiny import TINY_CONFIG, TinySource



class RecordingSource(TinySource):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.loaded: list[str] = []

    def load(self, name):
        self.loaded.append(name)
        return super().load(name)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("num_stages", [2, 3, 5])
def test_each_stage_loads_exactly_its_blocks_and_role_tensors(tied, num_stages):
    import attrs
    config = attrs.evolve(TINY_CONFIG, tie_embeddings=tied)
    head = "token_embd.weight" if tied else "output.weight"
    for stage in range(num_stages):
        source = RecordingSource(config=config)
        worker = open_worker(tinygrad_model(source), Shard.of(stage, num_stages))
        layers = layer_range(config.n_layers, stage, num_stages)
        expected = {n for i in layers for n in block_tensor_names(i)}
        if stage == 0:
            expected.add("token_embd.weight")
        if stage == num_stages - 1:
            expected |= {"output_norm.weight", head}
        assert sorted(source.loaded) == sorted(expected)  # each once, nothing else
        assert len(worker.compute.model.blocks) == len(layers)


def test_weight_bytes_over_all_stages_is_the_model_plus_the_duplicated_tied_embedding():
    source = TinySource()
    total = sum(source.load(n).nbytes for n in source.names())
    stages = [open_worker(tinygrad_model(source), Shard.of(s, 4)) for s in range(4)]
    embedding = source.load("token_embd.weight").nbytes
    assert sum(w.info.weight_bytes for w in stages) == total + embedding  # tied: first embeds, last's head
