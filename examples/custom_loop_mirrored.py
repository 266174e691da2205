"""TensorFlow's custom training loop, the tf.distribute tutorial's form, two ways.

``custom_loop_mirrored.py`` runs it under ``tf.distribute.MirroredStrategy``;
``custom_loop_zero.py`` is the same file with the strategy lines changed, and trains it
with ZeRO stage 3, parameters and optimizer states offloaded to NVMe files (under
``$NVME_PATH``, default a new temporary directory). Run either as
``python examples/<file> [--steps N] [--out weights.npz]``.
"""

import argparse
import os
import tempfile

import keras
import numpy as np
import tensorflow as tf

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
parser.add_argument("--out", help="write the final weights to this .npz file")
args = parser.parse_args()
NVME = os.environ.get("NVME_PATH") or tempfile.mkdtemp(prefix="zero_nvme_")

strategy = tf.distribute.MirroredStrategy()

GLOBAL_BATCH_SIZE = 16
rng = np.random.default_rng(0)
x = rng.normal(size=(GLOBAL_BATCH_SIZE * args.steps, 32)).astype("float32")
y = rng.integers(0, 10, size=(GLOBAL_BATCH_SIZE * args.steps,)).astype("int64")
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH_SIZE)
dist_dataset = strategy.experimental_distribute_dataset(dataset)

with strategy.scope():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32,))
    h = keras.layers.Dense(64, activation="relu")(inputs)
    h = keras.layers.Add()([h, keras.layers.Dense(64, activation="relu")(h)])
    model = keras.Model(inputs, keras.layers.Dense(10)(h))
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    optimizer = keras.optimizers.Adam(learning_rate=1e-3)
    optimizer.build(model.trainable_variables)


def compute_loss(labels, predictions):
    per_example_loss = loss_object(labels, predictions)
    return tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)


def train_step(inputs):
    features, labels = inputs
    with tf.GradientTape() as tape:
        predictions = model(features, training=True)
        loss = compute_loss(labels, predictions)
    gradients = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return loss


@tf.function
def distributed_train_step(dataset_inputs):
    per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)


for step, batch in enumerate(dist_dataset):
    loss = distributed_train_step(batch)
    print(f"step {step} loss {float(loss):.6f}")
if args.out:
    np.savez(args.out, *[np.asarray(v.numpy()) for v in model.weights])
