// Entry module of the Memory Hierarchy View. TensorBoard loads it inside the plugin's
// iframe (data/plugin_entry.html?name=memory_hierarchy) and calls render().
// This module is the controller: it asks the model for data and hands it to the views.

import uPlotCss from 'uplot/dist/uPlot.min.css';
import { checkpointMarkers, configEvents, configMarkers, restartMarkers } from './data.js';
import {
  CHART_POINTS,
  FULL_POINTS,
  CHECKPOINT_TAGS,
  Model,
  TAG_CONFIG_EVENT,
  TAG_ESTIMATE,
  TAG_OOM,
  TAG_PAGES,
  TAG_PLACEMENT,
  TAG_READINGS,
  TAG_RUN_INFO,
  TAG_TIERS,
  TAG_TIMING,
} from './model.js';
import viewCss from './style.css';
import { renderCheckpoints } from './views/checkpoint_table.js';
import { renderRestarts } from './views/restarts_view.js';
import { renderConfigList } from './views/config_list.js';
import { renderEstimate } from './views/estimate_table.js';
import { clearWidthCache } from './views/chart.js';
import { DiffView } from './views/diff_view.js';
import { OomView } from './views/oom_view.js';
import { OverlayView } from './views/overlay_view.js';
import { PagesView } from './views/pages_view.js';
import { PlacementTable } from './views/placement_table.js';
import {
  createRunPanel,
  renderExports,
  renderFacts,
  renderReadout,
  renderStatus,
} from './views/run_panel.js';
import { RunSelector, runColor } from './views/run_selector.js';
import { drawing } from './schedule.js';
import { recencyOf } from './selection.js';
import { TierCharts } from './views/tier_chart.js';
import { TimingView } from './views/timing_view.js';
import { TuningPanel } from './views/tuning_panel.js';
import { markerWhatifText } from './whatif.js';

const POLL_MS = 5000; // how often a live run is checked for new steps (milliseconds)
// Performance mark set once the tier charts of every selected run in view have drawn.
const FIRST_PAINT_MARK = 'mh-first-meaningful-paint';
// The first selected runs' panels are filled at once; the others when they scroll within
// LAZY_MARGIN of the view (IntersectionObserver), so hundreds of selected runs cost
// nothing until seen.
const EAGER_RUNS = 4;
const LAZY_MARGIN = '800px 0px';

function injectStyles(doc) {
  // CSP: TensorBoard's style-src allows inline <style>; scripts come only from 'self'.
  const style = doc.createElement('style');
  style.textContent = `${uPlotCss}\n${viewCss}`;
  doc.head.append(style);
}

const nextFrame = () => new Promise((resolve) => requestAnimationFrame(() => resolve()));

/**
 * Give each config marker of a user request predicted at apply its predicted-beside-
 * measured text (`whatif`, the marker's tooltip); returns `markers`.
 * @param {Array<{version?: number|null}>} markers
 * @param {object[]} [predictions] GET /tuning's `predictions`
 */
function withWhatif(markers, predictions = []) {
  const byVersion = new Map(predictions.map((p) => [p.version, p]));
  for (const marker of markers) {
    const p = marker.version === null || marker.version === undefined ? null : byVersion.get(marker.version);
    if (p) marker.whatif = markerWhatifText(p);
  }
  return markers;
}

/** One run's views and the data they last drew. */
class RunView {
  constructor(run, model) {
    this.run = run;
    this.parts = createRunPanel(run);
    this.oom = new OomView(this.parts.oomSection, this.parts.oomBody);
    this.tuning = new TuningPanel(
      this.parts.tuningBody,
      (updates) => model.tune(run, updates),
      (updates) => model.whatif(run, updates),
    );
    this.tierCharts = new TierCharts(this.parts.chartBox);
    this.pages = new PagesView(this.parts.pagesBody);
    this.timing = new TimingView(this.parts.timingBody);
    this.placement = new PlacementTable(this.parts.placementBody);
    this.token = 0; // bumped per refresh: an older refresh's results are dropped
    this.drawn = false; // the tier charts have drawn at least once
    this.shown = {}; // name -> the answer last drawn
    this.changed = false; // round 1 drew something new: round 2 redraws too
    this.tiers = null;
    this.readings = null;
    this.runInfo = null;
    this.markers = [];
  }

  resize() {
    this.tierCharts.resize();
    this.pages.resize();
    this.timing.resize();
    this.oom.resize();
  }
}

/** The controller: keeps the run selector and one panel per selected run in sync. */
class App {
  constructor(root, model) {
    this.root = root;
    this.model = model;
    this.views = new Map(); // run -> RunView
    this.selected = new Set();
    this.runNames = [];
    this.refreshing = false;
    this.firstPaintDone = false;
    this.firstViewAsked = false; // GET /first_view is asked once, by the first refresh
    this.active = new Set(); // runs whose panels have come into view: fetched and drawn
    this.tuningPoll = null; // {runs: Set, answer: Promise} of the current poll's /tuning_states
    this.observer =
      typeof IntersectionObserver === 'function'
        ? new IntersectionObserver((items) => this.onIntersect(items), { rootMargin: LAZY_MARGIN })
        : null;
    const header = document.createElement('h1');
    header.className = 'mh-header';
    header.textContent = 'Memory Hierarchy';
    this.status = document.createElement('p');
    this.status.className = 'mh-status mh-global-status';
    const selectorBox = document.createElement('div');
    this.selector = new RunSelector(selectorBox, (selected) => this.select(selected));
    this.overlay = new OverlayView();
    // "Compare runs" (GET /diff): a closed section, fetched only once opened.
    this.diff = new DiffView(model);
    this.list = document.createElement('div');
    this.list.className = 'mh-runs';
    root.append(header, this.status, selectorBox, this.overlay.element, this.diff.element, this.list);
  }

  view(run) {
    let view = this.views.get(run);
    if (!view) {
      view = new RunView(run, this.model);
      this.views.set(run, view);
      if (this.observer) this.observer.observe(view.parts.element);
      else this.active.add(run); // no IntersectionObserver: every panel is filled
    }
    return view;
  }

  /** Panels that came into view: fill them (once; polls keep them fresh after). */
  onIntersect(items) {
    const runs = [];
    for (const item of items) {
      const run = item.target.dataset.run;
      if (item.isIntersecting && !this.active.has(run) && this.selected.has(run)) {
        this.active.add(run);
        runs.push(run);
      }
    }
    if (runs.length && this.entries) this.refreshRuns(runs);
  }

  /** Show the panels of the selected runs, in name order; refresh them unless told not. */
  select(selected, refresh = true) {
    this.selected = selected;
    const order = this.runNames.filter((r) => selected.has(r));
    for (const [run, view] of this.views) {
      if (!selected.has(run)) {
        view.parts.element.remove();
        this.active.delete(run); // filled again when selected and seen again
      }
    }
    order.slice(0, EAGER_RUNS).forEach((r) => this.active.add(r));
    this.list.replaceChildren(...order.map((r) => this.view(r).parts.element));
    this.updateOverlay();
    if (refresh && this.entries) return this.refreshRuns(order);
    return Promise.resolve();
  }

  /**
   * Refresh runs in two rounds: first what every run's tier charts need (so the first
   * meaningful paint waits for no other view), then the other views.
   */
  async refreshRuns(runs) {
    const jobs = runs
      .filter((run) => this.active.has(run))
      .map((run) => this.entries.get(run))
      .filter(Boolean)
      .map((entry) => {
        const view = this.view(entry.run);
        return { entry, view, token: ++view.token };
      });
    clearWidthCache();
    await Promise.all(jobs.map((j) => this.refreshTiers(j.entry, j.view, j.token)));
    this.updateOverlay();
    await Promise.all(jobs.map((j) => this.refreshOthers(j.entry, j.view, j.token)));
  }

  /** Fetch /runs, then whatever changed for the selected runs; refreshes never overlap. */
  async refresh() {
    if (this.refreshing) return;
    this.refreshing = true;
    try {
      const runs = await this.listRuns();
      this.entries = new Map(runs.map((e) => [e.run, e]));
      this.runNames = runs.map((e) => e.run);
      renderStatus(
        this.status,
        runs.length ? '' : 'No memory_hierarchy data found in this logdir yet.',
      );
      const recency = new Map(runs.map((e) => [e.run, recencyOf(e)]));
      const selected = this.selector.setRuns(this.runNames, recency);
      await this.select(selected, false);
      const versions = new Map(runs.map((e) => [e.run, e.tags[TAG_TIERS]?.max_step ?? -1]));
      this.diff.setRuns(this.runNames, selected, recency, versions);
      const shown = this.runNames.filter((r) => selected.has(r) && this.active.has(r));
      // One request for every shown run's live-tuning state (not one /tuning per run),
      // sent by the first run's round 2 (after the tier charts: the first paint waits
      // for no request it does not draw).
      this.tuningPoll = shown.length ? { runs: new Set(shown), answer: null } : null;
      await this.refreshRuns(shown);
    } catch (err) {
      renderStatus(this.status, `Could not load runs: ${err.message}`, true);
    } finally {
      this.refreshing = false;
    }
  }

  /**
   * The /runs listing. The first time, GET /first_view brings the first panels' answers
   * with it (the remembered selection's first runs by name, else the server picks the
   * default ones the same way); if that route fails, /runs alone.
   */
  async listRuns() {
    if (this.firstViewAsked) return this.model.runs();
    this.firstViewAsked = true;
    const remembered = [...this.selector.selected].sort().slice(0, EAGER_RUNS);
    try {
      return await this.model.firstView(remembered, { limit: this.selector.limit, eager: EAGER_RUNS });
    } catch {
      return this.model.runs();
    }
  }

  /** Fetch a tag of a run if it has one (null otherwise); json tags give their events. */
  fetchTag(entry, tag, kind) {
    const info = entry.tags[tag];
    if (!info) return Promise.resolve(null);
    if (info.error) return Promise.reject(new Error(info.error));
    return kind === 'json'
      ? this.model.json(entry.run, tag, info.max_step)
      : this.model.series(entry.run, tag, info.max_step);
  }

  /** Round 1 of a run's refresh: facts, config changes, tier charts, readout. */
  async refreshTiers(entry, view, token) {
    const stale = () => token !== view.token || !this.selected.has(entry.run);
    const { parts } = view;
    try {
      const [tiers, readings, runInfoAnswer, configAnswer] = await Promise.all([
        this.fetchTag(entry, TAG_TIERS, 'series'),
        this.fetchTag(entry, TAG_READINGS, 'series').catch(() => null),
        this.fetchTag(entry, TAG_RUN_INFO, 'json'),
        this.fetchTag(entry, TAG_CONFIG_EVENT, 'json').catch(() => null),
      ]);
      if (stale()) return;
      parts.element.dataset.filled = '1'; // its real height from now on (see style.css)
      const round = { tiers, readings, runInfoAnswer, configAnswer };
      view.changed = Object.entries(round).some(([k, v]) => view.shown[k] !== v);
      if (!view.changed) return;
      // Drawing goes through the scheduler in short jobs (one per tier chart); a job of a
      // refresh that went stale meanwhile does nothing, and what it would have shown is
      // drawn by the newer refresh (view.shown is updated only once all is drawn).
      const draw = (job) => drawing.run(() => (stale() ? null : job()));
      const events = runInfoAnswer?.events ?? [];
      view.runInfo = events.length ? events[events.length - 1].value : null;
      view.markers = withWhatif(configMarkers(configAnswer), view.predictions);
      await draw(() => {
        renderFacts(parts.facts, view.runInfo);
        renderConfigList(parts.configList, configEvents(configAnswer), view.predictions);
        renderStatus(parts.status, tiers?.steps.length ? '' : 'No tier data recorded yet.');
      });
      if (!tiers || !tiers.steps.length) {
        if (!stale()) Object.assign(view.shown, round);
        return;
      }
      view.tiers = tiers;
      view.readings = readings;
      await view.tierCharts.update(tiers, readings, view.runInfo, view.markers, draw);
      await draw(() => {
        renderReadout(parts.readout, tiers, view.runInfo);
        this.renderTierExports(view, entry);
      });
      if (stale()) return;
      Object.assign(view.shown, round);
      await nextFrame();
      view.drawn = true;
      parts.element.dataset.drawn = '1';
      this.markFirstPaint();
    } catch (err) {
      view.changed = false;
      if (!stale()) renderStatus(parts.status, `Could not load this run: ${err.message}`, true);
    }
  }

  /** A run's OOM post-mortem (GET /oom) if it recorded one, else null. */
  fetchOom(entry) {
    const info = entry.tags[TAG_OOM];
    if (!info || info.error) return Promise.resolve(null);
    return this.model.oom(entry.run, info.max_step);
  }

  /** A run's checkpoint saves and restores (GET /checkpoints) if it recorded any, else null. */
  fetchCheckpoints(entry) {
    // Saves and restores have a tag each; either one means the run has records.
    const infos = CHECKPOINT_TAGS.map((tag) => entry.tags[tag]);
    if (!infos.some(Boolean)) return Promise.resolve(null);
    const broken = infos.find((info) => info?.error);
    if (broken) return Promise.reject(new Error(broken.error));
    return this.model.checkpoints(entry.run, infos.map((info) => info?.max_step ?? -1).join('/'));
  }

  /**
   * Round 2 of a run's refresh: estimate, page moves, step time (with checkpoint and
   * restart markers), checkpoints, restarts and goodput, placement, the OOM post-mortem and
   * the live-tuning panel (tuning and restarts are read at every poll: they live in files,
   * not in the event stream).
   */
  async refreshOthers(entry, view, token) {
    const stale = () => token !== view.token || !this.selected.has(entry.run);
    const { parts } = view;
    const failed = (err) => ({ error: err });
    const answers = await Promise.all([
      this.fetchTag(entry, TAG_PAGES, 'series').catch(failed),
      this.fetchTag(entry, TAG_TIMING, 'series').catch(failed),
      this.fetchTag(entry, TAG_PLACEMENT, 'json').catch(failed),
      this.fetchTag(entry, TAG_ESTIMATE, 'json').catch(() => null),
      this.fetchOom(entry).catch(() => null),
      this.tuningOf(entry.run).catch(failed),
      this.fetchCheckpoints(entry).catch(failed),
      this.model.restarts(entry.run).catch(failed),
    ]);
    const [pages, timing, placement, estimateAnswer, oomAnswer, tuningAnswer, checkpoints, restarts] =
      answers;
    if (stale()) return;
    const force = view.changed; // new tiers or markers: redraw everything
    // A new /restarts answer each poll: compare what it shows, not the object.
    const restartsKey = JSON.stringify([restarts?.error?.message, restarts?.markers, restarts?.goodput]);
    const newMarkers = view.shown.checkpoints !== checkpoints || view.shown.restartsKey !== restartsKey;
    // One scheduler job per view (schedule.js): no long task with many runs. A job of a
    // refresh that went stale does nothing; view.shown is updated once all has drawn.
    const jobs = [
      () => {
        if (tuningAnswer?.error) view.tuning.update(null, tuningAnswer.error.message);
        else {
          view.tuning.update(tuningAnswer);
          // Config changes: predicted beside measured for the requests predicted at apply.
          const predictions = tuningAnswer?.predictions ?? [];
          if (predictions.length) {
            view.predictions = predictions;
            renderConfigList(view.parts.configList, configEvents(view.shown.configAnswer), predictions);
            // The charts' markers of those changes carry it too (from their next draw).
            withWhatif(view.markers ?? [], predictions);
          }
        }
        if (force || view.shown.oomAnswer !== oomAnswer) {
          view.oom.update(oomAnswer, view.runInfo);
          // The overlay shows the failed step's allocator peak beside the recorded ones.
          const pm = oomAnswer?.postmortem;
          const peak = pm?.readings?.framework_device_peak_bytes;
          const oomPeak = typeof peak === 'number' && typeof pm?.step === 'number' ? { step: pm.step, value: peak } : null;
          if (JSON.stringify(oomPeak) !== JSON.stringify(view.oomPeak ?? null)) {
            view.oomPeak = oomPeak;
            this.updateOverlay();
          }
        }
        if (force || view.shown.estimateAnswer !== estimateAnswer) {
          const events = estimateAnswer?.events ?? [];
          const estimate = events.length ? events[events.length - 1].value : null;
          renderEstimate(parts.estimate, estimate, view.tiers, view.runInfo, view.shown.readings);
        }
      },
      () => this.drawSeriesView(view, 'pages', pages, force),
      () => {
        // The step-time charts also mark the run's checkpoint saves and restores, and the
        // steps its job resumed at after a restart or resize.
        if (force || view.shown.checkpoints !== checkpoints) {
          const error = checkpoints?.error?.message ?? null;
          renderCheckpoints(parts.checkpointsBody, error ? null : checkpoints, error);
        }
        if (force || view.shown.restartsKey !== restartsKey) {
          const error = restarts?.error?.message ?? null;
          renderRestarts(parts.restartsBody, error ? null : restarts, error);
        }
        const timingMarkers = [
          ...(view.markers ?? []),
          ...(checkpoints?.error ? [] : checkpointMarkers(checkpoints)),
          ...(restarts?.error ? [] : restartMarkers(restarts)),
        ];
        this.drawSeriesView(view, 'timing', timing, force || newMarkers, timingMarkers);
      },
      () => {
        if (view.shown.placement === placement) return;
        view.placement.update(placement?.error ? null : placement);
        const ok = placement && !placement.error;
        const url = (format) => this.model.jsonExportUrl(entry.run, TAG_PLACEMENT, format);
        renderExports(
          parts.exports.placement,
          ok
            ? [this.link('CSV', url('csv'), 'csv', 'all'), this.link('JSON', url('json'), 'json', 'all')]
            : [],
        );
      },
    ];
    for (const job of jobs) await drawing.run(() => (stale() ? null : job()));
    if (stale()) return;
    Object.assign(view.shown, { pages, timing, placement, estimateAnswer, oomAnswer, checkpoints, restartsKey });
    view.changed = false;
  }

  /** A run's /tuning answer: from this poll's /tuning_states when it covers the run. */
  async tuningOf(run) {
    const poll = this.tuningPoll;
    if (poll?.runs.has(run)) {
      poll.answer ??= this.model.tuningStates([...poll.runs]);
      const answer = (await poll.answer).runs?.[run];
      if (answer?.error) throw new Error(answer.error.message);
      if (answer) return answer;
    }
    return this.model.tuning(run);
  }

  drawSeriesView(view, name, answer, force, markers = view.markers ?? []) {
    if (!force && view.shown[name] === answer) return;
    const target = name === 'pages' ? view.pages : view.timing;
    const tag = name === 'pages' ? TAG_PAGES : TAG_TIMING;
    if (answer?.error) {
      target.update(null, markers);
      target.body.firstChild.textContent = `Could not load: ${answer.error.message}`;
      target.body.firstChild.classList.add('mh-error');
      renderExports(view.parts.exports[name], []);
      return;
    }
    target.update(answer, markers);
    renderExports(view.parts.exports[name], answer ? this.seriesLinks(view.run, tag, name) : []);
  }

  link(label, href, format, scope) {
    return { label, href, format, scope };
  }

  /** CSV and JSON links of a series tag: as shown (thinned) and every step. */
  seriesLinks(run, tag, name) {
    const m = this.model;
    return [
      this.link(`${name} CSV`, m.seriesExportUrl(run, tag, 'csv', CHART_POINTS), 'csv', 'shown'),
      this.link(`${name} JSON`, m.seriesExportUrl(run, tag, 'json', CHART_POINTS), 'json', 'shown'),
      this.link(`${name} CSV (every step)`, m.seriesExportUrl(run, tag, 'csv', FULL_POINTS), 'csv', 'full'),
      this.link(`${name} JSON (every step)`, m.seriesExportUrl(run, tag, 'json', FULL_POINTS), 'json', 'full'),
    ];
  }

  renderTierExports(view, entry) {
    const links = this.seriesLinks(entry.run, TAG_TIERS, 'tiers');
    if (entry.tags[TAG_READINGS]) links.push(...this.seriesLinks(entry.run, TAG_READINGS, 'readings'));
    renderExports(view.parts.exports.tiers, links);
  }

  /** Mark the first meaningful paint once every selected run in view has drawn. */
  markFirstPaint() {
    if (this.firstPaintDone || !this.selected.size) return;
    let drawn = 0;
    for (const run of this.selected) {
      if (!this.active.has(run)) continue; // not in view: drawn when scrolled to
      if (!this.views.get(run)?.drawn) return;
      drawn += 1;
    }
    if (!drawn) return;
    this.firstPaintDone = true;
    performance.mark(FIRST_PAINT_MARK);
    document.body.dataset.firstPaint = 'done';
    document.body.dataset.firstPaintRuns = String(drawn);
  }

  updateOverlay() {
    const runs = this.runNames
      .map((run, index) => ({ run, index }))
      .filter(({ run }) => this.selected.has(run) && this.views.get(run)?.tiers)
      .map(({ run, index }) => ({
        run,
        color: runColor(index),
        tiers: this.views.get(run).tiers,
        readings: this.views.get(run).readings ?? null,
        oomPeak: this.views.get(run).oomPeak ?? null,
      }));
    drawing.run(() => this.overlay.update(this.selected.size > 1 ? runs : []));
  }

  resize() {
    clearWidthCache();
    for (const view of this.views.values()) view.resize();
    this.overlay.resize();
    this.diff.resize();
  }
}

/** Called by TensorBoard once the iframe has loaded this module. */
export async function render() {
  performance.mark('mh-render-start');
  injectStyles(document);
  const model = new Model(new URL('./', import.meta.url));
  const app = new App(document.body, model);
  window.addEventListener('resize', () => app.resize());
  await app.refresh();
  setInterval(() => {
    if (!document.hidden) app.refresh();
  }, POLL_MS);
}
