"""ElasticSampler (hora.elastic.sampler): its state is Horovod 0.28.1's two counts, and an older form still loads."""

from __future__ import annotations

from hora.elastic import ElasticSampler


def test_sampler_state_dict_is_horovod_028s_two_counts_and_loads_hora_s_older_form() -> None:
    """Horovod 0.28.1's sampler state is ``{'epoch', 'processed_num'}``, two ints a checkpoint stores as they
    are; hora's older ``{'epoch', 'processed_indices'}`` still loads, counted as that many samples."""
    sampler = ElasticSampler(range(6), shuffle=False)
    assert list(iter(sampler)) == [0, 1, 2, 3, 4, 5] and len(sampler) == 6
    sampler.record_batch(0, 3)
    assert sampler.state_dict() == {"epoch": 0, "processed_num": 3}
    assert all(type(v) is int for v in sampler.state_dict().values())
    resumed = ElasticSampler(range(6), shuffle=False)
    resumed.load_state_dict(sampler.state_dict())
    assert list(iter(resumed)) == [3, 4, 5] and len(resumed) == 3
    older = ElasticSampler(range(6), shuffle=False)
    older.load_state_dict({"epoch": 0, "processed_indices": {0, 1, 2}})
    assert older.processed_num == 3 and list(iter(older)) == [3, 4, 5]
    older.set_epoch(1)
    assert older.processed_num == 0 and list(iter(older)) == list(range(6))
