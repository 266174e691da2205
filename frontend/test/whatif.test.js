// node --test: the what-if panel's rows and sentences from /whatif and /tuning answers.
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { markerWhatifText, outcomeText, totalMoves, whatifHeadline, whatifRows, whatifScope } from '../src/whatif.js';

const summary = (moves, peak, extra = {}) => ({
  moves_per_step: moves,
  peak_bytes: { device: peak, host: 2 ** 20, nvme: 0 },
  used_bytes: { device: peak, host: 2 ** 20, nvme: 0 },
  prefetch_misses: 0,
  stall_seconds: 0,
  ...extra,
});

const answer = {
  available: true,
  steps: [12, 13, 14],
  recorded: summary({ d2h: 0, h2d: 0, h2n: 0, n2h: 0 }, 4 * 2 ** 20),
  predicted: { steady: summary({ d2h: 15.5, h2d: 15, h2n: 0, n2h: 0 }, 2 ** 20, { stall_seconds: null, prefetch_misses: 3 }) },
  oom: null,
};

test('whatifRows gives now and predicted per figure', () => {
  const rows = Object.fromEntries(whatifRows(answer).map((r) => [r.key, r]));
  assert.equal(rows.moves_d2h.now, '0');
  assert.equal(rows.moves_d2h.predicted, '15.5');
  assert.equal(rows.moves_h2d.predictedValue, 15);
  assert.equal(rows.device_peak.now, '4 MiB');
  assert.equal(rows.device_peak.predicted, '1 MiB');
  assert.equal(rows.stall.predicted, 'unknown');
  assert.equal(rows.stall.now, '0.0 ms');
  assert.equal(totalMoves(answer.predicted.steady), 30.5);
});

test('the whole run\'s recorded figures stand beside the pool\'s, and the scope says what is outside the replay', () => {
  const scoped = {
    ...answer,
    scope: "the stage-3 pool's pages only",
    run_recorded: {
      moves_per_step: { d2h: 0, h2d: 0, h2n: 264, n2h: 264 },
      prefetch_misses: 128,
      stall_seconds: 0.207,
      nvme_used_bytes: 11 * 2 ** 20,
      steps: 3,
    },
  };
  const rows = Object.fromEntries(whatifRows(scoped).map((r) => [r.key, r]));
  assert.equal(rows.moves_h2n.now, '0');
  assert.equal(rows.moves_h2n.whole, '264');
  assert.equal(rows.misses.wholeValue, 128);
  assert.equal(rows.stall.whole, '207.0 ms');
  assert.equal(rows.nvme_used.whole, '11 MiB');
  assert.equal(rows.device_peak.whole, '\u2014');
  assert.equal(
    whatifScope(scoped),
    "Replayed: the stage-3 pool's pages only. Over these steps the whole run recorded 528 page " +
      'moves per step (Page moves panel), the pool 0: 528 per step are outside the replay and stay as recorded.',
  );
  // An answer without the run's figures: no whole column, the scope alone.
  assert.equal(whatifRows(answer)[0].whole, '\u2014');
  assert.equal(whatifScope({ ...scoped, run_recorded: null }), "Replayed: the stage-3 pool's pages only.");
  assert.equal(whatifScope({ available: false, reason: 'x' }), '');
});

test('whatifHeadline states the replay, an OOM, or why there is none', () => {
  assert.equal(
    whatifHeadline(answer),
    "Predicted from steps 12\u201314 replayed through the pool's policy: page moves 0 \u2192 30.5 per step; pool device peak 4 MiB \u2192 1 MiB.",
  );
  assert.equal(
    whatifHeadline({ ...answer, oom: { step: 13, message: 'cannot place 4 pages\nmore' } }),
    'Predicted from steps 12\u201314 replayed: the job would run out of memory at step 13 (cannot place 4 pages).',
  );
  assert.equal(whatifHeadline({ available: false, reason: 'no access trace recorded yet' }), 'No prediction: no access trace recorded yet');
});

test('outcomeText puts predicted beside measured with the error', () => {
  const o = {
    version: 2,
    applied_step: 57,
    predicted: { moves_total: 30, device_peak_bytes: 2 ** 20 },
    measured: { moves_total: 25, device_peak_bytes: 2 ** 20 },
  };
  assert.equal(
    outcomeText(o),
    'v2 (applied at step 57): page moves per step predicted 30, measured 25 (+20%); pool device peak predicted 1 MiB, measured 1 MiB (+0%).',
  );
  assert.equal(outcomeText({ ...o, applied_step: null, measured: null }), 'v2: predicted page moves 30 per step, pool device peak 1 MiB; not applied yet.');
  assert.equal(
    markerWhatifText(o),
    'page moves/step predicted 30, measured 25; pool device peak predicted 1 MiB, measured 1 MiB',
  );
});

test('a panel that cannot apply but can predict says so, and the budget bounds name the run', async () => {
  const { boundsText, predictOnlyText } = await import('../src/views/tuning_panel.js');
  assert.equal(
    predictOnlyText([92, 93, 99]),
    'Its recorded access trace (steps 92\u201399) can still be replayed: enter new values and ' +
      '\u201cPredict effect\u201d shows what the change would have done to those steps; nothing is written.',
  );
  const spec = { key: 'device_budget_bytes', min: 65536, max: 2 ** 50, unit: 'bytes' };
  assert.equal(boundsText(spec), '64 KiB \u2026 1 PiB (bytes)');
  assert.equal(
    boundsText(spec, 262144),
    '64 KiB \u2026 1 PiB (bytes); this run\u2019s pool: whole pages of 256 KiB, and at least what its ' +
      'gathers pin at once (below it Predict effect shows the out-of-memory failure)',
  );
  assert.equal(boundsText({ key: 'telemetry_every_n_steps', min: 1, max: 10 ** 6, unit: 'steps' }, 262144), '1 \u2026 1,000,000 (steps)');
});
