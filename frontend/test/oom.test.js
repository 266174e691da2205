// node --test: what the OOM view and the run's facts say (frontend/src/oom.js).
import assert from 'node:assert/strict';
import { test } from 'node:test';
import {
  adviceVerdictText,
  deviceBudgetNote,
  oomFigureNotes,
  oomHeadline,
  oomRecentPanels,
  oomTierFigures,
  requestText,
  runBadges,
} from '../src/oom.js';

const MIB = 2 ** 20;

test('the headline shows the requested bytes, or says why they are not known', () => {
  const pool = { step: 49, failed_request: { bytes: 96 * MIB, tier: 'device', error_type: 'PoolOutOfMemoryError' } };
  assert.equal(oomHeadline(pool, 49, 'device'), 'Out of memory at step 49 on device: 96 MiB requested.');
  const budget = { step: 0, failed_request: { bytes: null, tier: 'device', error_type: 'DeviceBudgetExceededError' } };
  const text = oomHeadline(budget, 0, 'device (CPU stand-in)');
  assert.ok(!text.includes('—'), text); // was "— requested"
  assert.ok(text.includes('no single request: the budget is checked at the step boundary'), text);
  // The report's own sentence wins over the view's fallback.
  assert.equal(requestText({ failed_request: {}, request_text: 'the pool named none' }), 'the pool named none');
  assert.equal(
    requestText({ failed_request: { error_type: 'ResourceExhaustedError' } }),
    'request size not known: the error named no tensor shape',
  );
});

test('a tier row: used is the holders\u2019 sum of one accounting; the checked reading is named beside it', () => {
  const row = {
    capacity_bytes: 12 * MIB,
    used_bytes: 44 * MIB,
    accounted_bytes: 44 * MIB,
    checked_bytes: 28 * MIB,
    checked_source: 'allocator',
    holders: [],
  };
  const f = oomTierFigures(row);
  assert.equal(f.text, '44 MiB of 12 MiB (367%)');
  assert.equal(f.checkedText, "TensorFlow's allocator read 28 MiB at the check");
  // When the reading is the figure itself, it is not repeated.
  assert.equal(oomTierFigures({ ...row, checked_bytes: 44 * MIB }).checkedText, null);
  assert.equal(oomTierFigures({ used_bytes: 0, capacity_bytes: null }).text, '0 B used (capacity unbounded)');
  const notes = oomFigureNotes({ figures: { used_bytes: 'the sum of the holders', checked_bytes: { allocator: 'bytes in use' } } });
  assert.deepEqual(notes, ['Used: the sum of the holders.', 'Read at the check (allocator): bytes in use.']);
  assert.equal(oomFigureNotes({}).length, 1); // an older report says it predates them
  // TensorFlow's allocator refused a request: its in-step peak is the figure.
  const refused = oomTierFigures({ ...row, capacity_bytes: 36 * MIB, checked_bytes: 35.5 * MIB, checked_source: 'allocator_peak' });
  assert.equal(refused.checkedText, 'TensorFlow’s allocator peaked at 35.5 MiB in the step, then refused the request');
});

test('advice verdicts carry the replayed bytes; an older report\u2019s missing bytes still show', () => {
  assert.equal(
    adviceVerdictText({ verdict: 'fits', fits: true, predicted_bytes: 9 * MIB }, 12 * MIB),
    'fits (predicted 9 MiB of 12 MiB with the margin)',
  );
  assert.equal(
    adviceVerdictText({ verdict: 'does not fit', predicted_bytes: 28 * MIB, missing_bytes: 16 * MIB }, 12 * MIB),
    'does not fit (16 MiB over)',
  );
  assert.equal(
    adviceVerdictText({ verdict: 'may fit', predicted_bytes: 11 * MIB, missing_bytes: 2 * MIB }, 12 * MIB),
    'may fit (predicted 11 MiB of 12 MiB: within the capacity, 2 MiB short of the margin)',
  );
  assert.equal(adviceVerdictText({ verdict: 'may fit', missing_bytes: 8 * MIB }, null), 'may fit (8 MiB short of the margin)');
  assert.equal(adviceVerdictText({ fits: true }, null), 'fits');
  // A budget raise: against the raised budget, not the one that failed.
  const raise = { change: { device_budget_bytes: 18 * MIB }, verdict: 'fits', predicted_bytes: 14 * MIB };
  assert.equal(adviceVerdictText(raise, 5 * MIB), 'fits (predicted 14 MiB of 18 MiB with the margin)');
});

test('recent occupancy: one panel per tier, a capacity far above the use is left off scale', () => {
  const pm = {
    recent_steps: [0, 1].map((step) => ({
      step,
      tiers: {
        device: { used_bytes: (28 + step) * MIB, capacity_bytes: 12 * MIB },
        host: { used_bytes: 2 * MIB, capacity_bytes: 24 * 2 ** 30 },
        nvme: { used_bytes: null, capacity_bytes: null },
      },
    })),
  };
  const { steps, panels } = oomRecentPanels(pm);
  assert.deepEqual(steps, [0, 1]);
  assert.deepEqual(panels.map((p) => p.tier), ['device', 'host']); // NVMe never measured
  const [device, host] = panels;
  assert.deepEqual(device.capacity, [12 * MIB, 12 * MIB]);
  assert.ok(device.yMax >= 29 * MIB && device.yMax < 40 * MIB);
  assert.equal(host.capacity, null); // 24 GiB would flatten 2 MiB at zero
  assert.ok(host.yMax < 3 * MIB, host.yMax);
  assert.ok(host.notes.includes('capacity 24 GiB (off scale)'), host.notes);
  // A tier at 0 B: its capacity is off scale too (the line stays visible at the bottom).
  const empty = oomRecentPanels({ recent_steps: [{ step: 0, tiers: { host: { used_bytes: 0, capacity_bytes: 2 ** 30 } } }] });
  assert.equal(empty.panels[0].capacity, null);
  assert.equal(empty.panels[0].yMax, 1024);
});

test('badges: stage 0 is the baseline, not a fallback; the stand-in is named once', () => {
  const label = 'device (CPU stand-in)';
  const stage0 = { stage: 0, fallback_mirrored: true, device_is_standin: true, device_description: label };
  assert.deepEqual(runBadges(stage0, label), [{ kind: 'baseline', text: 'plain data parallelism (stage 0, the baseline)' }]);
  const small = { stage: 2, fallback_mirrored: true, device_is_standin: true, device_description: 'CPU:0 budget 256 MiB' };
  assert.deepEqual(
    runBadges(small, label).map((b) => b.kind),
    ['standin', 'fallback'],
  );
  assert.deepEqual(runBadges({ stage: 3, fallback_mirrored: false, device_is_standin: false }, label), []);
  assert.deepEqual(runBadges(null, label), []);
});

test('the device note says what the budget bounds and what the allocator peak holds', () => {
  const stage3 = deviceBudgetNote({ stage: 3, device_is_standin: true });
  assert.ok(stage3.includes('paged pool'), stage3);
  assert.ok(stage3.includes('budgeted stand-in'), stage3);
  assert.ok(stage3.includes('activations'), stage3);
  const stage0 = deviceBudgetNote({ stage: 0, device_is_standin: false });
  assert.ok(stage0.includes('step boundary') && !stage0.includes('stand-in'), stage0);
  assert.equal(deviceBudgetNote(null), null);
  const unset = deviceBudgetNote({ stage: 1, config: { device_budget_bytes: null } });
  assert.ok(unset.startsWith('Device budget: none is set'), unset);
  const set = deviceBudgetNote({ stage: 3, config: { device_budget_bytes: 12 * MIB } });
  assert.ok(set.includes('paged pool'), set);
  // With the run's figures: the allocator peak against the device's memory, and the
  // accounting line above the pool budget explained (shards outside the pool) or flagged.
  const info = { stage: 3, device_is_standin: true, config: { device_budget_bytes: 12 * MIB } };
  const figures = {
    allocator: { value: 22 * MIB, step: 4 },
    accounting: { value: 13.7 * MIB, step: 0, grad: 1.7 * MIB },
    budget: 12 * MIB,
    cap: 32 * MIB,
    stage3: true,
    overrun: null,
    outsidePool: 1.7 * MIB,
  };
  const note = deviceBudgetNote(info, figures);
  assert.ok(note.includes('highest 22 MiB at step 4, against the device’s memory of 32 MiB'), note);
  assert.ok(note.includes('TF_CPU_BFC_MEM_LIMIT_IN_MB'), note);
  assert.ok(note.includes('within it'), note);
  assert.ok(note.includes('above the pool budget by up to 1.7 MiB: the gradient shards outside the pool'), note);
  assert.ok(!note.includes('OVERRUN'), note);
  const flagged = deviceBudgetNote(info, { ...figures, overrun: { bytes: 2 * MIB, step: 3 } });
  assert.ok(flagged.includes('OVERRUN: the pool’s own pages went over its budget by 2 MiB at step 3'), flagged);
});

test('predicted vs measured names what the Ψ-only prediction does not model', async () => {
  const { estimateNotes } = await import('../src/views/estimate_table.js');
  const rows = [
    { tier: 'device', predicted: 5 * MIB, measured: 2 * MIB },
    { tier: 'host', predicted: 0, measured: 20 * MIB },
    { tier: 'nvme', predicted: 16 * MIB, measured: 22 * MIB },
  ];
  const estimate = { not_modelled: { host: ["the paged pool's host window for NVMe pages"], nvme: ['page rounding'] } };
  assert.deepEqual(estimateNotes(estimate, rows, (t) => t), [
    "host: not modelled: the paged pool's host window for NVMe pages.",
    'nvme: not modelled: page rounding.',
  ]);
  // An older estimate without the notes: a 0 prediction measured above 0 is still named.
  assert.deepEqual(estimateNotes({}, rows, (t) => t), [
    'host: predicted 0, measured 20 MiB: held by something the estimator does not count.',
  ]);
});
