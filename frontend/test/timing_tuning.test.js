// node --test: the timing chart's traced steps and the tuning panel's request line.
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { tracedSteps, TIMING_PARTS } from '../src/views/timing_parts.js';
import {
  actsAtRebuild,
  changesNothingNow,
  endedText,
  requestText,
} from '../src/views/tuning_panel.js';

test('traced steps are kept out of the y-range; without a traced step the chart scales to all', () => {
  const series = {
    steps: [0, 1, 2, 3],
    values: {
      step_seconds: [4.2, 0.11, 0.13, 0.12],
      comm_seconds: [0.5, 0.02, NaN, 0.03],
      traced: [1, 0, 0, 0],
    },
  };
  const { traced, top } = tracedSteps(series, ['step_seconds', 'comm_seconds']);
  assert.deepEqual(traced, [{ step: 0, seconds: 4.2 }]);
  assert.equal(top, 0.13);
  const none = tracedSteps({ ...series, values: { ...series.values, traced: [0, 0, 0, 0] } }, ['step_seconds']);
  assert.deepEqual(none, { traced: [], top: null });
  const old = tracedSteps({ steps: [0], values: { step_seconds: [1] } }, ['step_seconds']);
  assert.deepEqual(old, { traced: [], top: null }); // a run written before the column
  assert.ok(TIMING_PARTS.some((p) => p.column === 'io_seconds'));
  assert.ok(TIMING_PARTS.some((p) => p.column === 'stall_seconds'));
});

test('the request line says which keys changed nothing in the running job', () => {
  const keys = [
    { key: 'telemetry_every_n_steps', takes_effect: 'next step' },
    { key: 'persistence_threshold', takes_effect: "rebuild (stage 3's traced plan)" },
  ];
  assert.equal(actsAtRebuild(keys[1]), true);
  assert.equal(actsAtRebuild(keys[0]), false);
  const both = {
    state: 'applied',
    version: 3,
    step: 12,
    changes: { telemetry_every_n_steps: { old: 1, new: 2 }, persistence_threshold: { old: 0, new: 100 } },
  };
  assert.equal(
    requestText(both, keys, 0),
    'Request v3: applied at step 12 (telemetry_every_n_steps 1 → 2); recorded, changes nothing ' +
      'in the running job: persistence_threshold 0 → 100.',
  );
  // A next-step key that does not act at this run's stage (acts: false) changes nothing.
  const idle = { key: 'prefetch_bucket_size', takes_effect: 'next step (stage 3 …)', acts: false };
  assert.equal(changesNothingNow(idle), true);
  assert.equal(changesNothingNow({ ...idle, acts: true }), false);
  const prefetch = { ...both, changes: { prefetch_bucket_size: { old: 5, new: 0 } } };
  assert.ok(!requestText(prefetch, [...keys, idle], 0).includes('applied'));
  const later = { ...both, changes: { persistence_threshold: { old: 0, new: 100 } } };
  assert.ok(!requestText(later, keys, 0).includes('applied'));
  assert.equal(
    requestText({ ...both, changes: {} }, keys, 0),
    'Request v3: changed nothing at step 12 (its values were already in effect).',
  );
  assert.equal(requestText(null, keys, 0), 'No live-tuning request yet.');
});

test('endedText names how the job ended: an OOM at its step, a close after its last step', () => {
  const oom = endedText({ reason: 'oom', step: 5 });
  assert.ok(oom.includes('out-of-memory failure at step 5'), oom);
  assert.ok(oom.includes('apply the advice'), oom);
  const closed = endedText({ reason: 'closed', step: 100 });
  assert.ok(closed.includes('closed after step 99'), closed);
  assert.ok(!closed.includes('out-of-memory'), closed);
});
