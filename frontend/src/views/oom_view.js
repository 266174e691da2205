// View: the out-of-memory post-mortem of a run (GET /oom; the shared OOM contract in
// docs/http/reports.md): the summary a human reads first, the failed request (or why its size
// is not known), each tier at the moment of failure as a bar against its capacity with what
// each figure measures (one accounting: used = the holders' sum; the checked reading
// beside it), the holders, the last steps' occupancy as one small chart per tier (each its
// own scale), and the advice ranked with its replayed bytes. Every text from the
// post-mortem (tensor names, messages, advice) goes through textContent, never HTML.

import { formatConfigValue, oomHolders, rankedAdvice, TIERS } from '../data.js';
import { formatBytes } from '../format.js';
import {
  adviceVerdictText,
  oomFigureNotes,
  oomHeadline,
  oomRecentPanels,
  oomTierFigures,
  requestText,
} from '../oom.js';
import { Chart } from './chart.js';
import { el, tierLabel } from './run_panel.js';

const HEIGHT = 150; // px, one panel per tier
const TIER_COLORS = { device: '#1a73e8', host: '#12a05c', nvme: '#e8710a' };

function facts(rows) {
  const dl = el('dl', 'mh-oom-facts');
  for (const [name, value] of rows) {
    if (value === null || value === undefined || value === '') continue;
    const item = el('div', 'mh-oom-fact');
    item.dataset.fact = name;
    item.append(el('dt', null, name), el('dd', null, String(value)));
    dl.append(item);
  }
  return dl;
}

function tierBar(tier, info, runInfo, failedTier) {
  const f = oomTierFigures(info);
  const row = el('div', 'mh-oom-tier');
  row.dataset.tier = tier;
  if (f.used !== null) row.dataset.usedBytes = String(f.used);
  if (f.capacity !== null) row.dataset.capacityBytes = String(f.capacity);
  if (f.checked !== null) row.dataset.checkedBytes = String(f.checked);
  if (f.source !== null) row.dataset.checkedSource = f.source;
  if (tier === failedTier) row.classList.add('mh-oom-failed-tier');
  const track = el('span', 'mh-bar-track mh-oom-track');
  const fill = el('span', 'mh-bar mh-oom-fill');
  fill.style.width = `${f.share === null ? 0 : Math.min(100, 100 * f.share)}%`;
  track.append(fill);
  const text = el('span', 'mh-oom-tier-text', f.text);
  if (f.checkedText) text.append(el('span', 'mh-oom-checked', ` · ${f.checkedText}`));
  row.append(el('span', 'mh-oom-tier-name', tierLabel(tier, runInfo)), track, text);
  return row;
}

function changeText(change) {
  return Object.entries(change ?? {})
    .map(([k, v]) => `${k} = ${formatConfigValue(k, v)}`)
    .join(', ');
}

/** The OOM view of one run; create once, then update with each /oom answer. */
export class OomView {
  /** @param {HTMLElement} section the whole section (hidden when there is no post-mortem) */
  constructor(section, body) {
    this.section = section;
    this.body = body;
    this.charts = [];
    this.section.hidden = true;
  }

  /**
   * @param {object|null} answer a /oom answer ({run, step, wall_time, count, postmortem})
   * @param {object|null} runInfo the latest run_info (labels the stand-in device tier)
   */
  update(answer, runInfo) {
    const pm = answer?.postmortem;
    if (!pm || typeof pm !== 'object') {
      this.section.hidden = true;
      this.body.replaceChildren();
      this.charts = [];
      return;
    }
    this.section.hidden = false;
    this.section.dataset.step = String(answer.step);
    const fr = pm.failed_request ?? {};
    const headline = el(
      'p',
      'mh-oom-headline',
      oomHeadline(pm, answer.step, tierLabel(String(fr.tier ?? '?'), runInfo)),
    );
    const summary = el('p', 'mh-oom-summary', String(pm.summary ?? ''));

    const request = el('div', 'mh-oom-request');
    if (typeof fr.bytes === 'number') request.dataset.bytes = String(fr.bytes);
    request.dataset.tier = String(fr.tier ?? '');
    request.append(
      el('h4', 'mh-subtitle', 'Failed request'),
      facts([
        ['bytes', typeof fr.bytes === 'number' ? `${formatBytes(fr.bytes)} (${fr.bytes} bytes)` : requestText(pm)],
        ['tier', fr.tier],
        ['tensor', fr.tensor],
        ['op', fr.op],
        ['error', fr.error_type],
      ]),
    );
    if (fr.message) {
      // The framework's own error text is long and raw: folded, one click away.
      const details = el('details', 'mh-oom-details');
      details.append(
        el('summary', null, 'Error text (as raised)'),
        el('pre', 'mh-oom-message', String(fr.message)),
      );
      request.append(details);
    }

    const tiersBox = el('div', 'mh-oom-tiers');
    tiersBox.append(el('h4', 'mh-subtitle', 'Tiers at the moment of failure'));
    for (const tier of TIERS) {
      if (pm.tiers?.[tier]) tiersBox.append(tierBar(tier, pm.tiers[tier], runInfo, fr.tier));
    }
    for (const note of oomFigureNotes(pm)) tiersBox.append(el('p', 'mh-note mh-oom-figure-note', note));

    const holders = el('table', 'mh-oom-holders');
    const head = el('tr');
    for (const t of ['tier', 'holder', 'kind', 'bytes', 'pages']) head.append(el('th', null, t));
    holders.append(head);
    for (const h of oomHolders(pm)) {
      const tr = el('tr');
      tr.dataset.tier = h.tier;
      if (h.bytes !== null) tr.dataset.bytes = String(h.bytes);
      tr.append(
        el('td', null, tierLabel(h.tier, runInfo)),
        el('td', 'mh-oom-holder-name', h.name),
        el('td', null, h.kind),
        el('td', 'mh-num', formatBytes(h.bytes)),
        el('td', 'mh-num', h.pages === null ? '—' : String(h.pages)),
      );
      holders.append(tr);
    }
    const holdersBox = el('div', 'mh-oom-holders-box');
    holdersBox.append(el('h4', 'mh-subtitle', 'Holders'), holders);

    const recentBox = el('div', 'mh-oom-recent');
    recentBox.append(
      el('h4', 'mh-subtitle', 'Occupancy over the last steps (one scale per tier)'),
      el('p', 'mh-note', 'Each step’s recorded use: the figure the limit check reads.'),
    );
    const recent = oomRecentPanels(pm);
    const panelBoxes = [];
    for (const panel of recent.panels) {
      const cell = el('div', 'mh-oom-recent-tier');
      cell.dataset.tier = panel.tier;
      const head = el('div', 'mh-tier-head');
      head.append(
        el('span', 'mh-tier-title', tierLabel(panel.tier, runInfo)),
        el('span', 'mh-tier-notes', panel.notes.join(' · ')),
      );
      const box = el('div', 'mh-plot');
      box.dataset.points = String(recent.steps.length);
      cell.append(head, box);
      recentBox.append(cell);
      panelBoxes.push([panel, box]);
    }

    const adviceBox = el('div', 'mh-oom-advice-box');
    adviceBox.append(el('h4', 'mh-subtitle', 'What would have made it fit (best first)'));
    const list = el('ol', 'mh-oom-advice');
    const capacity = pm.tiers?.[fr.tier]?.capacity_bytes ?? null;
    for (const a of rankedAdvice(pm)) {
      const li = el('li', 'mh-oom-advice-item');
      li.dataset.rank = String(a?.rank ?? '');
      li.dataset.fits = String(a?.fits === true);
      // `verdict` ("fits" / "may fit" / "does not fit", replayed on the recorded figures);
      // reports without it (older runs) have only the `fits` flag.
      const known = ['fits', 'may fit', 'does not fit'];
      li.dataset.verdict = known.includes(a?.verdict) ? a.verdict : a?.fits === true ? 'fits' : 'does not fit';
      if (typeof a?.frees_bytes === 'number') li.dataset.freesBytes = String(a.frees_bytes);
      li.append(
        el('span', 'mh-oom-advice-desc', String(a?.description ?? '')),
        el('span', 'mh-oom-advice-change', changeText(a?.change)),
        el(
          'span',
          'mh-oom-advice-meta',
          `frees ${formatBytes(typeof a?.frees_bytes === 'number' ? a.frees_bytes : null)} · ` +
            `${adviceVerdictText(a, typeof capacity === 'number' ? capacity : null)} · ` +
            `speed cost ${a?.speed_cost ?? 'unknown'}`,
        ),
      );
      list.append(li);
    }
    adviceBox.append(list);
    if (pm.nothing_fits === true) {
      adviceBox.append(el('p', 'mh-note mh-oom-nothing', 'No single setting is verified to fit.'));
    }

    const grid = el('div', 'mh-oom-grid');
    grid.append(request, tiersBox, recentBox, adviceBox);
    this.body.replaceChildren(headline, summary, grid, holdersBox);

    this.charts = [];
    for (const [panel, box] of panelBoxes) {
      const chart = new Chart(box, { height: HEIGHT, widthKey: 'oom' });
      const label = tierLabel(panel.tier, runInfo);
      const series = [{ label: `${label} used`, values: panel.used, stroke: TIER_COLORS[panel.tier], width: 2 }];
      if (panel.capacity) {
        series.push({ label: `${label} capacity`, values: panel.capacity, stroke: TIER_COLORS[panel.tier], dash: [4, 4] });
      }
      chart.update({ x: recent.steps, series, scales: { y: { unit: 'bytes', max: panel.yMax } }, markers: [] });
      this.charts.push(chart);
    }
    if (!panelBoxes.length) recentBox.append(el('p', 'mh-note', 'No recent steps recorded.'));
  }

  resize() {
    for (const chart of this.charts) chart.resize();
  }
}
