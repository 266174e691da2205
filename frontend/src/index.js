// Entry module of the Memory Hierarchy View. TensorBoard loads it inside the plugin's
// iframe (data/plugin_entry.html?name=memory_hierarchy) and calls render().

import uPlotCss from 'uplot/dist/uPlot.min.css';
import { Model, TAG_RUN_INFO, TAG_TIERS } from './model.js';
import viewCss from './style.css';
import {
  createRunPanel,
  renderFacts,
  renderReadout,
  renderStatus,
} from './views/run_panel.js';
import { TierChart } from './views/tier_chart.js';

const POLL_MS = 5000; // how often a live run is checked for new steps (milliseconds)

function injectStyles(doc) {
  // CSP: TensorBoard's style-src allows inline <style>; scripts come only from 'self'.
  const style = doc.createElement('style');
  style.textContent = `${uPlotCss}\n${viewCss}`;
  doc.head.append(style);
}

/** The controller: keeps one panel per run in sync with the model. */
class App {
  constructor(root, model) {
    this.root = root;
    this.model = model;
    this.panels = new Map(); // run -> {view, chart, series}
    this.refreshing = false;
    this.status = document.createElement('p');
    this.status.className = 'mh-status mh-global-status';
    const header = document.createElement('h1');
    header.className = 'mh-header';
    header.textContent = 'Memory Hierarchy';
    this.list = document.createElement('div');
    this.list.className = 'mh-runs';
    root.append(header, this.status, this.list);
  }

  panel(run) {
    let panel = this.panels.get(run);
    if (!panel) {
      const view = createRunPanel(run);
      panel = { view, chart: new TierChart(view.chartBox), series: null, runInfo: null };
      this.panels.set(run, panel);
      this.list.append(view.element);
    }
    return panel;
  }

  /** Fetch /runs, then whatever changed; refreshes never overlap. */
  async refresh() {
    if (this.refreshing) return;
    this.refreshing = true;
    try {
      const runs = await this.model.runs();
      renderStatus(
        this.status,
        runs.length ? '' : 'No memory_hierarchy data found in this logdir yet.',
      );
      for (const entry of runs) await this.refreshRun(entry);
    } catch (err) {
      renderStatus(this.status, `Could not load runs: ${err.message}`, true);
    } finally {
      this.refreshing = false;
    }
  }

  async refreshRun(entry) {
    const panel = this.panel(entry.run);
    const { view } = panel;
    try {
      const infoTag = entry.tags[TAG_RUN_INFO];
      let runInfo = null;
      if (infoTag?.kind) {
        const info = await this.model.json(entry.run, TAG_RUN_INFO, infoTag.max_step);
        runInfo = info.events.length ? info.events[info.events.length - 1].value : null;
      }
      const tiersTag = entry.tags[TAG_TIERS];
      if (!tiersTag) {
        renderFacts(view.facts, runInfo);
        renderStatus(view.status, 'No tier data recorded yet.');
        return;
      }
      if (tiersTag.error) throw new Error(tiersTag.error);
      const series = await this.model.series(entry.run, TAG_TIERS, tiersTag.max_step);
      // Re-check after the awaits: draw only data that is new for this panel.
      if (series === panel.series && runInfo === panel.runInfo) return;
      const shown = panel.series?.steps;
      const newest = series.steps[series.steps.length - 1] ?? -1;
      if (shown?.length && shown[shown.length - 1] > newest) return;
      panel.series = series;
      panel.runInfo = runInfo;
      renderFacts(view.facts, runInfo);
      renderStatus(view.status, series.steps.length ? '' : 'No tier data recorded yet.');
      panel.chart.update(series, runInfo);
      renderReadout(view.readout, series, runInfo);
    } catch (err) {
      renderStatus(view.status, `Could not load this run: ${err.message}`, true);
    }
  }

  resize() {
    for (const panel of this.panels.values()) panel.chart.resize();
  }
}

/** Called by TensorBoard once the iframe has loaded this module. */
export async function render() {
  injectStyles(document);
  const model = new Model(new URL('./', import.meta.url));
  const app = new App(document.body, model);
  window.addEventListener('resize', () => app.resize());
  await app.refresh();
  setInterval(() => {
    if (!document.hidden) app.refresh();
  }, POLL_MS);
}
