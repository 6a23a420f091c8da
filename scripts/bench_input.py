"""Benchmark of the streaming input path: ms/step fed from TFRecord files vs pre-packed batches,
first-batch latency, and peak memory for a small and a large dataset on disk.

    python scripts/bench_input.py --mesh batch=8                 # 20 MB vs 2 GB of TFRecords
    python scripts/bench_input.py --mesh batch=8 --large_mb 200  # quicker
    python scripts/bench_input.py --multi_client                 # 2 clients x 4: parity vs scale

The pipeline is what users write: ``TFRecordDataset`` over shard files, ``parse_single_example``,
normalization, and a random shift of up to 2 pixels (augmentation, new every epoch), then
``dtk.DistributedDataset`` (global batches from tf.data, packed by a background thread). The same
train step (the MNIST MLP on the mesh) runs once fed by that stream and once from batches packed
in advance; the goal is the stream within 5% of pre-packed. Peak RSS is measured in a fresh
process per dataset, training ``--steps`` steps; the goal is the 2 GB dataset within 1.2x of the
20 MB one (memory bounded by the prefetch depth, not the data).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from absl import flags

from dtk import usage

_MESH = flags.DEFINE_string("mesh", "batch=8", "Mesh spec.")
_BATCH = flags.DEFINE_integer("global_batch_size", 128, "Global batch size.")
_STEPS = flags.DEFINE_integer("steps", 60, "Timed steps per measurement.")
_SPC = flags.DEFINE_integer("steps_per_call", 10, "Batches per compiled call (what "
                            "steps_per_execution='auto' picks for this MLP here); 1: one per call.")
_SMALL_MB = flags.DEFINE_integer("small_mb", 20, "Size of the small dataset on disk.")
_LARGE_MB = flags.DEFINE_integer("large_mb", 2048, "Size of the large dataset on disk.")
_WORK_DIR = flags.DEFINE_string("work_dir", None, "Where to write the TFRecords (default: temp).")
_CHILD = flags.DEFINE_string("child", None, "Internal: measure RSS on this directory.")
_MULTI = flags.DEFINE_bool("multi_client", False, "Time the stream on 2 clients x 4 devices in "
                           "both multi-client modes (parity, scale) instead.")
_CLIENT_MODE = flags.DEFINE_enum("client_mode", None, ["parity", "scale"],
                                 "Internal: run as one client of a dtk.cluster.launch group.")

IMAGE_BYTES = 28 * 28


def write_tfrecords(directory: str, megabytes: int, *, shards: int = 8) -> int:
    """Writes about ``megabytes`` of MNIST-shaped random examples as ``shards`` files."""
    import numpy as np  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    os.makedirs(directory, exist_ok=True)
    n = megabytes * 2 ** 20 // (IMAGE_BYTES + 20)
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, (4096, IMAGE_BYTES), dtype=np.uint8)
    writers = [tf.io.TFRecordWriter(os.path.join(directory, f"data-{i:03d}.tfrecord"))
               for i in range(shards)]
    records = [tf.train.Example(features=tf.train.Features(feature={
        "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[row.tobytes()])),
        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[k % 10]))}))
        .SerializeToString() for k, row in enumerate(block)]
    for i in range(n):
        writers[i % shards].write(records[i % len(records)])
    for w in writers:
        w.close()
    return n


def pipeline(directory: str, shard=None):
    """TFRecord shards -> parse -> normalize -> random shift: unbatched (image, label).

    With a ``dtk.ClientShard`` (scale mode) only that client's files are read.
    """
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    files = sorted(tf.io.gfile.glob(os.path.join(directory, "*.tfrecord")))
    if shard is not None:
        files = files[shard.client_id::shard.num_clients]
    spec = {"image": tf.io.FixedLenFeature([], tf.string),
            "label": tf.io.FixedLenFeature([], tf.int64)}

    def parse(record):
        example = tf.io.parse_single_example(record, spec)
        image = tf.reshape(tf.io.decode_raw(example["image"], tf.uint8), [28, 28, 1])
        image = tf.cast(image, tf.float32) / 255.0
        shifted = tf.image.random_crop(tf.pad(image, [[2, 2], [2, 2], [0, 0]]), [28, 28, 1])
        return shifted, example["label"]

    return tf.data.TFRecordDataset(files).map(parse, num_parallel_calls=tf.data.AUTOTUNE)


def _setup(directory):
    import dtk  # pylint: disable=g-import-not-at-top
    from dtk.data import input as input_lib  # pylint: disable=g-import-not-at-top
    mesh = dtk.build_mesh(_MESH.value)
    trainer = dtk.Trainer(mesh=mesh, model=dtk.models.mnist_mlp, optimizer="adam",
                          config=dtk.TrainerConfig(verbose=0))
    data = input_lib.DistributedDataset(pipeline(directory).repeat(), mesh, input_lib.InputConfig(
        global_batch_size=_BATCH.value, shuffle=True, shuffle_buffer=10_000,
        steps_per_epoch=_STEPS.value))
    return trainer, data


def _items(data, epoch: int):
    """One epoch's packed items, as Keras's fit reads them from a DistributedDataset."""
    return data.keras_batches(epoch, steps_per_call=_SPC.value)


def _loop(model, items) -> float:
    """ms per step of the model's compiled train call (Keras's step, as fit runs it) over
    packed items: the input's cost is what the step waits for."""
    from dtk.train import keras_data  # pylint: disable=g-import-not-at-top

    class Packed(keras_data.EpochIterator):  # what the compiled call reads: take(count)
        def __init__(self, source):  # pylint: disable=super-init-not-called
            self._source = iter(source)

        def take(self, count, *, stack=True):
            return [next(self._source)]

    train, packed = model.make_train_function(), Packed(items)
    start = time.perf_counter()
    logs = None
    while True:
        try:
            logs = train(packed)
        except StopIteration:
            break
    float(logs["loss"])
    return 1000 * (time.perf_counter() - start) / _STEPS.value


def child(directory: str) -> None:
    """Trains ``--steps`` steps from the stream; prints peak RSS and first-batch latency (JSON)."""
    start = time.perf_counter()
    trainer, data = _setup(directory)
    items = _items(data, 0)
    first = next(items)
    first_s = time.perf_counter() - start
    _loop(trainer.model, [first, *items])
    print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "first_batch_s": first_s}))


def client(directory: str, mode: str) -> None:
    """One client of a 2-client group: ms/step of the streamed loop (client 0 prints JSON)."""
    import dtk  # pylint: disable=g-import-not-at-top
    import dtk.cluster.env  # pylint: disable=g-import-not-at-top
    from dtk.data import input as input_lib  # pylint: disable=g-import-not-at-top
    mesh = dtk.build_mesh(_MESH.value)
    trainer = dtk.Trainer(mesh=mesh, model=dtk.models.mnist_mlp, optimizer="adam",
                          config=dtk.TrainerConfig(verbose=0))
    config = input_lib.InputConfig(global_batch_size=_BATCH.value, shuffle=True,
                                   steps_per_epoch=_STEPS.value)
    if mode == "scale":
        data = input_lib.DistributedDataset.from_function(
            lambda shard: pipeline(directory, shard).repeat(), mesh, config)
    else:
        data = input_lib.DistributedDataset(pipeline(directory).repeat(), mesh, config)
    _loop(trainer.model, _items(data, 0))
    ms = statistics.median(_loop(trainer.model, _items(data, e)) for e in (1, 2, 3))
    if dtk.cluster.env.is_lead_client():
        print(json.dumps({"mode": mode, "ms_per_step": ms}), flush=True)


def multi_client(work: str) -> None:
    for mode in ("parity", "scale"):
        res = subprocess.run(
            [sys.executable, "-m", "dtk.cluster.launch", "--num_clients", "2", "--devices_per_client", "4",
             "--", sys.executable, os.path.abspath(__file__), f"--client_mode={mode}",
             f"--work_dir={work}", f"--mesh={_MESH.value}", f"--steps={_STEPS.value}",
             f"--global_batch_size={_BATCH.value}", f"--steps_per_call={_SPC.value}"],
            capture_output=True, text=True, timeout=900)
        lines = [line.split("] ", 1)[1] for line in res.stdout.splitlines()
                 if line.startswith("[client 0] {")]
        if res.returncode or not lines:
            raise SystemExit(res.stdout[-2000:] + res.stderr[-2000:])
        result = json.loads(lines[-1])
        print(f"  2 clients x 4, {mode:6} mode: {result['ms_per_step']:7.2f} ms/step "
              f"(streamed, {_STEPS.value} steps, median of 3 epochs)", flush=True)


def main(argv):
    del argv
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if _CHILD.value:
        child(_CHILD.value)
        return
    if _CLIENT_MODE.value:
        client(os.path.join(_WORK_DIR.value, "small"), _CLIENT_MODE.value)
        return
    if _MULTI.value:
        work = _WORK_DIR.value or tempfile.mkdtemp(prefix="dtk-bench-input-")
        if not os.path.isdir(os.path.join(work, "small")):
            write_tfrecords(os.path.join(work, "small"), _SMALL_MB.value)
        multi_client(work)
        return
    work = _WORK_DIR.value or tempfile.mkdtemp(prefix="dtk-bench-input-")
    sizes = {"small": _SMALL_MB.value, "large": _LARGE_MB.value}
    counts = {}
    for name, mb in sizes.items():
        start = time.perf_counter()
        counts[name] = write_tfrecords(os.path.join(work, name), mb)
        print(f"wrote {name}: {mb} MB, {counts[name]} examples in "
              f"{time.perf_counter() - start:.0f} s", flush=True)

    trainer, data = _setup(os.path.join(work, "small"))
    steps = trainer.model
    _loop(steps, _items(data, 0))                     # warm up: trace, fill buffers
    prepacked = list(_items(data, 1))
    rows = []
    for repeat in range(3):
        streamed_ms = _loop(steps, _items(data, 2 + repeat))
        prepacked_ms = _loop(steps, prepacked)
        rows.append((streamed_ms, prepacked_ms))
    streamed = statistics.median(r[0] for r in rows)
    packed = statistics.median(r[1] for r in rows)
    print(f"mesh {_MESH.value}, global batch {_BATCH.value}, {_STEPS.value} steps, "
          f"{_SPC.value} per call, median of 3:")
    print(f"  streamed from TFRecords (parse + normalize + shift): {streamed:7.2f} ms/step")
    print(f"  pre-packed batches:                                 {packed:7.2f} ms/step")
    print(f"  ratio streamed / pre-packed:                        {streamed / packed:7.3f}")
    rss = {}
    for name in sizes:
        res = subprocess.run([sys.executable, __file__, f"--child={os.path.join(work, name)}",
                              f"--mesh={_MESH.value}", f"--steps={_STEPS.value}",
                              f"--global_batch_size={_BATCH.value}",
                              f"--steps_per_call={_SPC.value}"],
                             capture_output=True, text=True, timeout=600)
        if res.returncode:
            raise SystemExit(res.stderr[-2000:])
        rss[name] = json.loads(res.stdout.strip().splitlines()[-1])
        print(f"  {name} ({sizes[name]} MB on disk): peak RSS {rss[name]['peak_rss_mb']:.0f} MB, "
              f"first batch {rss[name]['first_batch_s']:.2f} s after start")
    print(f"  peak RSS large / small: {rss['large']['peak_rss_mb'] / rss['small']['peak_rss_mb']:.3f}")


if __name__ == "__main__":
    usage.run_app(main)
