// View: one uPlot chart with config-change markers. Builds DOM from data, nothing else.
// Data contract: x is the step (ascending numbers); each series is an array parallel to x
// with null where not measured (drawn as a gap that lines span, never as 0).

import uPlot from 'uplot';
import {
  byteTicks,
  formatBytes,
  formatCount,
  formatPercent,
  formatSeconds,
  percentTicks,
  secondTicks,
} from '../format.js';

const DEFAULT_HEIGHT = 200; // px
const MIN_WIDTH = 240; // px
// Tick increments: whole steps (1, 2, 5, 10, ...) and bytes in powers of two.
const STEP_INCRS = [];
for (let e = 0; e <= 12; e++) for (const m of [1, 2, 5]) STEP_INCRS.push(m * 10 ** e);
const BYTE_INCRS = Array.from({ length: 61 }, (_, k) => 2 ** k);

/** Formatting of one y unit: legend values, axis ticks, tick increments. */
// `title`: the y-axis title a chart gets unless its scale names its own (`label`).
export const UNITS = {
  bytes: { format: formatBytes, ticks: byteTicks, incrs: BYTE_INCRS, size: 72, title: 'bytes' },
  seconds: {
    format: formatSeconds, ticks: secondTicks, incrs: undefined, size: 64, title: 'seconds',
  },
  count: { format: formatCount, ticks: undefined, incrs: undefined, size: 50, title: 'count' },
  ratio: { format: formatPercent, ticks: percentTicks, incrs: undefined, size: 50, title: 'ratio' },
};

/** The index of the last x whose row has a finite value in any series (null: none). */
export function lastIndex(data) {
  for (let i = (data[0]?.length ?? 0) - 1; i >= 0; i--) {
    for (let si = 1; si < data.length; si++) {
      const v = data[si]?.[i];
      if (v !== null && v !== undefined && Number.isFinite(v)) return i;
    }
  }
  return null;
}

/**
 * uPlot plugin: when the cursor is not over the plot, the legend shows the last step's
 * values (uPlot's live legend shows values only while hovering), so a chart is readable
 * at a glance; hovering shows the hovered step's as before.
 */
function latestLegendPlugin() {
  const showLast = (u) => {
    if (u.cursor.idx === null || u.cursor.idx === undefined) {
      const idx = lastIndex(u.data);
      if (idx !== null) u.setLegend({ idx });
    }
  };
  return { hooks: { ready: [showLast], setData: [showLast], setCursor: [showLast] } };
}

// Chart widths by kind ('tier', 'pages', ...), measured once per layout: reading
// clientWidth forces a layout, and doing it for each of dozens of charts as they are added
// costs more than drawing them. Cleared on resize and before each round of drawing.
const widthCache = new Map();

/** Forget measured chart widths (after a resize, or before a round of drawing). */
export function clearWidthCache() {
  widthCache.clear();
}

/** True when ``values`` holds fewer than two finite numbers. */
function fewerThanTwo(values) {
  let n = 0;
  for (const v of values ?? []) {
    if (v !== null && v !== undefined && Number.isFinite(v) && ++n >= 2) return false;
  }
  return true;
}

/**
 * uPlot plugin: vertical markers at steps (config changes, checkpoints), as DOM elements
 * over the plot (`.mh-marker[data-step]`, title = the change, and a live change's
 * predicted beside measured effect when it has one (`whatif`); a marker with a `kind` also
 * gets `data-kind` and the class `mh-marker-<kind>`), redrawn with the chart.
 * @param {() => Array<{step: number, label: string, kind?: string}>} getMarkers
 */
function markersPlugin(getMarkers) {
  let layer = null;
  return {
    hooks: {
      init: (u) => {
        layer = document.createElement('div');
        layer.className = 'mh-markers';
        u.over.append(layer);
      },
      draw: (u) => {
        layer.replaceChildren();
        const width = u.bbox.width / uPlot.pxRatio; // CSS px, without forcing a layout
        for (const marker of getMarkers()) {
          const left = u.valToPos(marker.step, 'x');
          if (!Number.isFinite(left) || left < 0 || left > width) continue;
          const line = document.createElement('div');
          line.className = 'mh-marker';
          line.dataset.step = String(marker.step);
          if (marker.kind) {
            line.dataset.kind = marker.kind;
            line.classList.add(`mh-marker-${marker.kind}`);
          }
          line.title = `step ${marker.step}: ${marker.label}${marker.whatif ? ` — ${marker.whatif}` : ''}`;
          if (marker.whatif) line.dataset.whatif = marker.whatif;
          line.style.left = `${left}px`;
          const tag = document.createElement('span');
          tag.className = 'mh-marker-label';
          // A config change names its keys and values on the chart ("12: key a → b");
          // other kinds (checkpoints, traced steps) show the step, the title says more.
          tag.textContent = marker.kind
            ? String(marker.step)
            : `${marker.step}: ${String(marker.label).replace(/^v\d+ applied: /, '')}`;
          line.append(tag);
          layer.append(line);
        }
      },
    },
  };
}

/**
 * One chart. `update(spec)` draws; the chart is rebuilt only when its series change.
 *
 * spec: {
 *   x: number[],
 *   series: [{label, values, stroke, fill?, dash?, width?, scale? ('y'), show?,
 *             legend?: (idx) => string}],
 *   scales: {y: {unit: 'bytes'|'seconds'|'count'|'ratio', label?: string (the axis
 *             title; default the unit's), max?: number, side?: 1}},
 *   markers: [{step, label, kind?}],
 * }
 */
export class Chart {
  /**
   * @param {HTMLElement} container the element the chart fills (its width is used)
   * @param {{height?: number, widthKey?: string}} options
   */
  constructor(container, { height = DEFAULT_HEIGHT, widthKey = null } = {}) {
    this.container = container;
    this.height = height;
    this.widthKey = widthKey; // charts sharing a key share one measured width
    this.plot = null;
    this.key = '';
    this.markers = [];
    this.ranges = {};
  }

  width() {
    const key = this.widthKey;
    if (key && widthCache.has(key)) return widthCache.get(key);
    const width = Math.max(MIN_WIDTH, this.container.clientWidth || 0);
    if (key && this.container.clientWidth) widthCache.set(key, width);
    return width;
  }

  options(spec) {
    const scaleNames = Object.keys(spec.scales);
    const scales = { x: { time: false } };
    const axes = [{ label: 'step', incrs: STEP_INCRS, size: 36 }];
    for (const name of scaleNames) {
      const unit = UNITS[spec.scales[name].unit];
      scales[name] = {
        range: (_u, min, max) => {
          const fixed = this.ranges[name];
          const top = fixed ?? max;
          return [Math.min(0, min ?? 0), top > 0 ? top * 1.05 : 1];
        },
      };
      axes.push({
        scale: name,
        label: spec.scales[name].label ?? unit.title,
        labelSize: 18,
        values: unit.ticks,
        incrs: unit.incrs,
        size: unit.size,
        side: spec.scales[name].side ?? 3,
        grid: { show: name === scaleNames[0] },
      });
    }
    const series = [{ label: 'step' }];
    for (const s of spec.series) {
      const unit = UNITS[spec.scales[s.scale ?? 'y'].unit];
      series.push({
        label: s.label,
        scale: s.scale ?? 'y',
        stroke: s.stroke,
        fill: s.fill,
        dash: s.dash,
        width: s.width ?? 1.5,
        show: s.show ?? true,
        spanGaps: true,
        // A series with one value (e.g. a run that failed at its first step) has no
        // line to draw: show its point instead.
        points: { show: (u, si) => fewerThanTwo(u.data[si]) },
        value: (_u, v, _si, idx) =>
          s.legend && idx !== null && idx !== undefined ? s.legend(idx) : unit.format(v),
      });
    }
    return {
      width: this.width(),
      height: this.height,
      scales,
      axes,
      series,
      legend: { live: true },
      cursor: { drag: { x: true, y: false } },
      plugins: [markersPlugin(() => this.markers), latestLegendPlugin()],
    };
  }

  /** Draw (or redraw) with a spec (see the class comment). */
  update(spec) {
    this.markers = spec.markers ?? [];
    this.ranges = Object.fromEntries(
      Object.entries(spec.scales).map(([name, s]) => [name, s.max ?? null]),
    );
    const key = JSON.stringify([
      spec.series.map((s) => [s.label, s.scale, s.show, s.stroke, s.dash]),
      Object.entries(spec.scales).map(([name, s]) => [name, s.unit, s.side, s.label]),
    ]);
    // uPlot draws the axis titles on its canvas; the container names them for tests and
    // assistive tools.
    this.container.dataset.axisTitles = [
      'step',
      ...Object.values(spec.scales).map((s) => s.label ?? UNITS[s.unit].title),
    ].join(' | ');
    const data = [spec.x, ...spec.series.map((s) => s.values)];
    if (this.plot && key === this.key) {
      this.plot.setData(data);
    } else {
      this.plot?.destroy();
      this.plot = new uPlot(this.options(spec), data, this.container);
      this.key = key;
    }
  }

  /** Fit the chart to its container's width. */
  resize() {
    this.plot?.setSize({ width: this.width(), height: this.height });
  }
}
