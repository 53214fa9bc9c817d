"""The ray engine of ``data curate`` and ``data prepare`` (preprocessing.engines) on a real
two-node Ray cluster on this machine (tests/ray_cluster.py), reading the corpus from and
writing everything to ``s3://`` on the moto server: the curated parts, the curation
record, the ``.bin/.idx`` shards and the manifest are byte for byte those of the local
engine (two worker processes) on the same input, and both nodes did work."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest

from megalith.config import load_config
from megalith.ray_cluster import connected
from preprocessing import corpus_generator
from preprocessing.curate import curate_corpus, curated_data
from preprocessing.engines import RayOrderedMap, WorkerError
from preprocessing.prepare import prepare_dataset
from preprocessing.tokenizer import load_tokenizer
from tests.ray_cluster import scale_or_fail

STORIES = Path(corpus_generator.__file__).parent / "sample_corpus" / "stories.jsonl"


def write_corpus(fs, bucket: str) -> None:
    """Two input files; the second repeats some documents of the first exactly and some
    with a few words added (near duplicates), so both dedup rules decide across files."""
    texts = [json.loads(line)["text"] for line in STORIES.read_text().splitlines()]
    first, second = texts[:1200], texts[1200:]
    second += first[:40] + [text + " And that was all." for text in first[40:80]]
    for name, part in (("a", first), ("b", second)):
        lines = "".join(json.dumps({"text": text}) + "\n" for text in part)
        fs.pipe_file(f"{bucket}/raw/{name}.jsonl", lines.encode())


def run(engine: str, bucket: str, storage: dict, address: str, tokenizer_file: Path):
    """Curate the raw corpus to OUT/curated, then tokenize that into OUT."""
    config = load_config(
        None,
        ["data.workers=2", "data.shards=3", "data.batch_documents=64"],
        {
            "data.inputs": [f"{bucket}/raw/"],
            "data.output": f"{bucket}/out",
            "data.storage_options": storage,
            "data.engine": engine,
            "data.ray_address": address,
        },
    )
    curated = curate_corpus(config.data, show_progress=False)
    tokenizer = load_tokenizer(str(tokenizer_file))
    data = curated_data(config.data, curated.output)
    prepared = prepare_dataset(data, tokenizer, show_progress=False)
    return curated, prepared


def files(fs, prefix: str) -> dict[str, bytes]:
    found = {}
    for path in fs.find(prefix):
        name = path.removeprefix(prefix.removeprefix("s3://") + "/")
        if "/.prepare/" in f"/{name}":
            continue  # resume markers: they name the run's own files
        data = fs.cat_file(path)
        if name == "manifest.json":  # the one field that says when, not what
            manifest = json.loads(data)
            manifest.pop("created_at")
            data = json.dumps(manifest, sort_keys=True).encode()
        found[name] = data
    return found


@pytest.mark.slow
def test_ray_engine_writes_the_local_engines_bytes_on_both_nodes(
    ray_cluster, s3_bucket: str, s3_endpoint: dict, tokenizer_file: Path
) -> None:
    fs = fsspec.filesystem("s3", **s3_endpoint)
    write_corpus(fs, s3_bucket)
    # The same output URL for both (the manifest names it): the local run's files are
    # read back and removed, so the Ray run reuses nothing.
    local = run("local", s3_bucket, s3_endpoint, ray_cluster.address, tokenizer_file)
    mine = files(fs, f"{s3_bucket}/out")
    fs.rm(f"{s3_bucket}/out", recursive=True)
    ray = run("ray", s3_bucket, s3_endpoint, ray_cluster.address, tokenizer_file)
    theirs = files(fs, f"{s3_bucket}/out")
    assert not ray[0].reused and ray[1].skipped == []
    assert sorted(mine) == sorted(theirs)
    assert {"curated/part-00000.jsonl", "curated/part-00001.jsonl", "curated/_curation.json",
            "manifest.json", "shard-00002.bin", "shard-00002.idx"} <= set(mine)  # fmt: skip
    for name in mine:
        assert mine[name] == theirs[name], name

    record = ray[0].record
    assert record.removed.counts["exact_duplicate"] == 40
    assert record.removed.counts["near_duplicate"] >= 30  # datasketch's LSH: a few may pass
    assert ray[1].manifest.documents == record.documents_out
    # Both nodes did work in both stages; the local engine ran none on Ray.
    nodes = {ray_cluster.cluster.head_node.node_id, ray_cluster.worker.node_id}
    assert set(ray[0].nodes) == nodes and set(ray[1].nodes) == nodes
    assert local[0].nodes == local[1].nodes == []

    # A task that raises fails the run naming the window's jobs (its documents, in the
    # stages); the results before it came back in order.
    with connected(ray_cluster.address):
        engine = RayOrderedMap(scale_or_fail, 10, lambda jobs: f"jobs {jobs[0]}-{jobs[-1]}", 4)
        results = []
        with pytest.raises(WorkerError, match="jobs 4-7: .*cannot handle job 7"):
            for job in range(12):
                results += engine.submit(job)
        engine.close()  # the window after the failing one finishes; nothing is left running
        # The earlier windows whole, then in order whatever of this one came before job 7.
        assert 4 <= len(results) <= 7 and results == [10 * j for j in range(len(results))]
