// node --test: the pure data helpers of the views.
import assert from 'node:assert/strict';
import { test } from 'node:test';
import {
  deviceFigures,
  alignTo,
  configLabel,
  filterPlacement,
  hitRate,
  offScale,
  predictedVsMeasured,
  shapeText,
  sortPlacement,
  tierPlot,
  unionSteps,
} from '../src/data.js';
import { formatPercent, formatSeconds } from '../src/format.js';

const MIB = 2 ** 20;
const GIB = 2 ** 30;

function tiersAnswer(steps, cells) {
  return { steps, values: cells };
}

test('unionSteps and alignTo merge differently thinned series', () => {
  assert.deepEqual(unionSteps([0, 2, 4], [0, 1, 4, 5]), [0, 1, 2, 4, 5]);
  assert.deepEqual(unionSteps([], [3]), [3]);
  assert.deepEqual(alignTo([0, 1, 2, 4, 5], [0, 4, 5], [10, 40, null]), [10, null, null, 40, null]);
});

test('a capacity more than 20x the peak use is off scale', () => {
  assert.equal(offScale(24 * GIB, 2 * MIB), true);
  assert.equal(offScale(20 * MIB, 1 * MIB), false);
  assert.equal(offScale(21 * MIB, 1 * MIB), true);
  assert.equal(offScale(null, MIB), false);
  assert.equal(offScale(MIB, 0), true);
});

test('tierPlot stacks holders, keeps unmeasured lines out and names off-scale lines', () => {
  const tiers = tiersAnswer([0, 1], {
    host: {
      used_bytes: [2 * MIB, 2 * MIB],
      capacity_bytes: [24 * GIB, 24 * GIB],
      param_bytes: [null, null],
      grad_bytes: [null, null],
      optimizer_bytes: [MIB, 1.5 * MIB],
      other_bytes: [MIB, 0.5 * MIB],
    },
  });
  const readings = { steps: [0, 1], values: { process_rss_bytes: [3 * MIB, 3 * MIB] } };
  const plot = tierPlot(tiers, readings, 'host');
  assert.deepEqual(plot.layers.map((l) => l.key), ['optimizer', 'other']);
  assert.deepEqual(plot.layers[1].top, [2 * MIB, 2 * MIB]);
  assert.deepEqual(plot.offScale, [{ kind: 'capacity', label: 'capacity', value: 24 * GIB }]);
  assert.deepEqual(plot.lines.map((l) => l.label), ['process RSS']);
  assert.equal(plot.yMax, 3 * MIB);
});

test('hitRate is null when nothing was prefetched, never 0', () => {
  assert.deepEqual(hitRate([3, 0, null], [1, 0, 1]), [0.75, null, null]);
});

test('configLabel prefers a description, then key old → new', () => {
  assert.equal(configLabel({ description: 'moved' }), 'moved');
  assert.equal(configLabel({ key: 'prefetch_depth', old: 1, new: 2 }), 'prefetch_depth: 1 → 2');
  assert.equal(configLabel({ x: 1 }), '{"x":1}');
});

test('predictedVsMeasured compares model states (param + grad + optimizer) at the last step', () => {
  const tiers = tiersAnswer([0, 1], {
    device: { used_bytes: [1, 500], param_bytes: [1, 100], grad_bytes: [1, 20], optimizer_bytes: [0, 0] },
    host: { used_bytes: [1, 300], param_bytes: [0, 0], grad_bytes: [null, null], optimizer_bytes: [1, 200] },
    nvme: { used_bytes: [0, 0], param_bytes: [null, null], grad_bytes: [null, null], optimizer_bytes: [null, null] },
  });
  const rows = predictedVsMeasured({ per_process: { device_bytes: 100, host_bytes: 100, nvme_bytes: 0 } }, tiers);
  assert.deepEqual(rows, [
    { tier: 'device', predicted: 100, measured: 120, ratio: 1.2, predictedPeak: null, measuredPeak: null, measuredPeakSource: null, peakRatio: null },
    { tier: 'host', predicted: 100, measured: 200, ratio: 2, predictedPeak: null, measuredPeak: null, measuredPeakSource: null, peakRatio: null },
    { tier: 'nvme', predicted: 0, measured: 0, ratio: null, predictedPeak: null, measuredPeak: null, measuredPeakSource: null, peakRatio: null },
  ]);
});

test('predictedVsMeasured falls back to used bytes without a holder split', () => {
  const tiers = tiersAnswer([0, 1], {
    device: { used_bytes: [1, 150] },
    host: { used_bytes: [1, 50] },
    nvme: { used_bytes: [null, null] },
  });
  const rows = predictedVsMeasured({ per_process: { device_bytes: 100, host_bytes: 100, nvme_bytes: 0 } }, tiers);
  assert.deepEqual(rows, [
    { tier: 'device', predicted: 100, measured: 150, ratio: 1.5, predictedPeak: null, measuredPeak: null, measuredPeakSource: null, peakRatio: null },
    { tier: 'host', predicted: 100, measured: 50, ratio: 0.5, predictedPeak: null, measuredPeak: null, measuredPeakSource: null, peakRatio: null },
    { tier: 'nvme', predicted: 0, measured: null, ratio: null, predictedPeak: null, measuredPeak: null, measuredPeakSource: null, peakRatio: null },
  ]);
});

test('tierPlot draws the in-step peaks (accounting and allocator) beside boundary use, never off scale', () => {
  const tiers = tiersAnswer([0, 1], {
    device: { used_bytes: [4 * MIB, 4 * MIB], peak_bytes: [5 * MIB, 6 * MIB], capacity_bytes: [null, null] },
  });
  // The allocator peaked at 28 MiB inside the step: 7x the boundary use, still drawn.
  const readings = { steps: [0, 1], values: { framework_device_peak_bytes: [26 * MIB, 28 * MIB] } };
  const plot = tierPlot(tiers, readings, 'device');
  const peaks = plot.lines.filter((l) => l.kind === 'peak');
  assert.deepEqual(peaks.map((l) => l.label), ['in-step peak', 'TensorFlow allocator peak (in step)']);
  // Each named by what it measures: at stage 3 the pool's pages + gradient shards; below
  // stage 3 the recorded peak is the allocator's own and is drawn once.
  const s3 = tierPlot(tiers, readings, 'device', { stage: 3, device_capacity_bytes: 32 * MIB });
  assert.deepEqual(
    s3.lines.map((l) => [l.kind, l.label]),
    [
      ['peak', 'pool pages + gradient shards (in step)'],
      ['peak', 'TensorFlow allocator peak (in step)'],
      ['capacity', 'device memory (allocator limit)'],
    ],
  );
  // The device's memory is judged on scale beside the peaks, not the boundary use alone.
  const small = tiersAnswer([0, 1], { device: { used_bytes: [MIB, MIB], peak_bytes: [13 * MIB, 13 * MIB], capacity_bytes: [12 * MIB, 12 * MIB] } });
  const capped = tierPlot(small, readings, 'device', { stage: 3, device_capacity_bytes: 36 * MIB });
  assert.deepEqual(capped.offScale, []);
  assert.ok(capped.lines.some((l) => l.label === 'device memory (allocator limit)'));
  const s0 = tierPlot(tiers, readings, 'device', { stage: 0 });
  assert.deepEqual(s0.lines.filter((l) => l.kind === 'peak').map((l) => l.label), ['TensorFlow allocator peak (in step)']);
  assert.deepEqual(peaks[1].values, [26 * MIB, 28 * MIB]);
  assert.equal(plot.stepPeak, 28 * MIB);
  assert.equal(plot.yMax, 28 * MIB);
  assert.equal(plot.peakUse, 4 * MIB);
  // A peak 25x the boundary use is still drawn: it is never left off scale.
  const far = { steps: [0, 1], values: { framework_device_peak_bytes: [100 * MIB, 100 * MIB] } };
  assert.equal(tierPlot(tiers, far, 'device').offScale.length, 0);
});

test('predictedVsMeasured compares the predicted in-step peak with the measured one', () => {
  const tiers = tiersAnswer([0, 1], {
    device: { used_bytes: [1, 100], peak_bytes: [1, 150], param_bytes: [1, 100], grad_bytes: [0, 0], optimizer_bytes: [0, 0] },
    host: { used_bytes: [1, 50], peak_bytes: [1, 60], param_bytes: [0, 0], grad_bytes: [0, 0], optimizer_bytes: [1, 50] },
    nvme: { used_bytes: [0, 0] },
  });
  const readings = { steps: [0, 1], values: { framework_device_peak_bytes: [5, 240] } };
  const estimate = {
    per_process: { device_bytes: 100, host_bytes: 50, nvme_bytes: 0 },
    per_process_peak: { device_bytes: 200, host_bytes: 50, nvme_bytes: 0 },
  };
  const rows = predictedVsMeasured(estimate, tiers, readings);
  // Device: the allocator's 240 beats the pool's 150; host: the pool's 60.
  assert.deepEqual(
    rows.map((r) => [r.tier, r.predictedPeak, r.measuredPeak, r.peakRatio]),
    [
      ['device', 200, 240, 1.2],
      ['host', 50, 60, 1.2],
      ['nvme', 0, null, null],
    ],
  );
  // A stage-3 estimate has no device peak (null): no ratio.
  const stage3 = { ...estimate, per_process_peak: { device_bytes: null, host_bytes: 50, nvme_bytes: 0 } };
  assert.equal(predictedVsMeasured(stage3, tiers, readings)[0].peakRatio, null);
});

test('placement rows sort numerically by bytes and shape, and filter by words', () => {
  const rows = [
    { name: 'b', shape: [2, 3], bytes: 24, optimizer_tier: 'host' },
    { name: 'a', shape: [10], bytes: 40, optimizer_tier: 'nvme' },
    { name: 'c', shape: [], bytes: 4, optimizer_tier: 'host' },
  ];
  assert.deepEqual(sortPlacement(rows, 'bytes', 'desc').map((r) => r.name), ['a', 'b', 'c']);
  assert.deepEqual(sortPlacement(rows, 'shape', 'asc').map((r) => r.name), ['c', 'b', 'a']);
  assert.deepEqual(sortPlacement(rows, 'name', 'asc').map((r) => r.name), ['a', 'b', 'c']);
  assert.deepEqual(filterPlacement(rows, 'HOST').map((r) => r.name), ['b', 'c']);
  assert.deepEqual(filterPlacement(rows, 'host 2×3').map((r) => r.name), ['b']);
  assert.equal(shapeText([]), 'scalar');
});

test('seconds and percentages format with units', () => {
  assert.equal(formatSeconds(0.002), '2 ms');
  assert.equal(formatSeconds(0.149), '149 ms');
  assert.equal(formatSeconds(1.5), '1.5 s');
  assert.equal(formatSeconds(null), '—');
  assert.equal(formatPercent(0.75), '75%');
});

test('deviceFigures names each device peak and flags only a pool overrun', () => {
  const tiers = tiersAnswer([0, 1, 2], {
    device: {
      used_bytes: [2 * MIB, 2 * MIB, 2 * MIB],
      // pool pages 12 MiB (= its budget) + 1.7 MiB of gradient shards outside the pool
      peak_bytes: [13.7 * MIB, 13 * MIB, 12 * MIB],
      grad_bytes: [1.7 * MIB, 1.7 * MIB, 1.7 * MIB],
      capacity_bytes: [12 * MIB, 12 * MIB, 12 * MIB],
    },
  });
  const readings = { steps: [0, 1, 2], values: { framework_device_peak_bytes: [20 * MIB, 22 * MIB, 21 * MIB] } };
  const info = { stage: 3, device_capacity_bytes: 32 * MIB };
  const f = deviceFigures(tiers, readings, info);
  assert.deepEqual(f.allocator, { value: 22 * MIB, step: 1 });
  assert.equal(f.accounting.value, 13.7 * MIB);
  assert.equal(f.accounting.step, 0);
  assert.equal(f.cap, 32 * MIB);
  assert.equal(f.budget, 12 * MIB);
  assert.equal(f.overrun, null);
  assert.ok(Math.abs(f.outsidePool - 1.7 * MIB) < 1, f.outsidePool);
  // The pool's own pages over its budget: flagged.
  const over = tiersAnswer([0], {
    device: { used_bytes: [2 * MIB], peak_bytes: [15 * MIB], grad_bytes: [1 * MIB], capacity_bytes: [12 * MIB] },
  });
  assert.deepEqual(deviceFigures(over, null, info).overrun, { bytes: 2 * MIB, step: 0 });
  assert.equal(deviceFigures(over, null, { stage: 0 }).overrun, null);
});

test('the overlay compares the device by one measure: the allocator peak when every run read it', async () => {
  const { overlayData, overlayTitle } = await import('../src/views/overlay_view.js');
  const tiers = (used) => tiersAnswer([0, 1], { device: { used_bytes: used } });
  const runs = [
    { run: 'mirrored', color: 'red', tiers: tiers([20 * MIB, null]), readings: { steps: [0, 1], values: { framework_device_peak_bytes: [25 * MIB, 36 * MIB] } } },
    { run: 'zero', color: 'blue', tiers: tiers([2 * MIB, 2 * MIB]), readings: { steps: [0, 1], values: { framework_device_peak_bytes: [24 * MIB, 26 * MIB] } } },
  ];
  assert.match(overlayTitle(runs, 'device'), /TensorFlow allocator peak \(in step\), the same measure for every run/);
  assert.deepEqual(overlayData(runs, 'device').series.map((s) => s.values), [[25 * MIB, 36 * MIB], [24 * MIB, 26 * MIB]]);
  // A run without the reading: used bytes, and the title says they are not one measure.
  const mixed = [runs[0], { ...runs[1], readings: null }];
  assert.match(overlayTitle(mixed, 'device'), /not one measure/);
  assert.deepEqual(overlayData(mixed, 'device').series.map((s) => s.values), [[20 * MIB, null], [2 * MIB, 2 * MIB]]);
  assert.equal(overlayTitle(runs, 'host'), 'host: used bytes');
  // A run that ran out of memory: its failed step's peak (from the post-mortem) is drawn.
  const failed = [{ ...runs[0], readings: { steps: [0], values: { framework_device_peak_bytes: [25 * MIB] } }, oomPeak: { step: 1, value: 36 * MIB } }, runs[1]];
  const data = overlayData(failed, 'device');
  assert.deepEqual(data.x, [0, 1]);
  assert.deepEqual(data.series[0].values, [25 * MIB, 36 * MIB]);
  assert.equal(data.series[0].label, 'mirrored (out of memory at step 1)');
});
