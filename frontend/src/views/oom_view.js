// View: the out-of-memory post-mortem of a run (GET /oom; the shared OOM contract in
// docs/http_api.md): the summary a human reads first, the failed request, each tier at the
// moment of failure as a bar against its capacity, the holders, the last steps' occupancy
// as a small chart, and the advice ranked. Every text from the post-mortem (tensor names,
// messages, advice) goes through textContent, never HTML.

import { formatConfigValue, oomHolders, oomRecentSeries, rankedAdvice, TIERS } from '../data.js';
import { formatBytes, formatPercent } from '../format.js';
import { Chart } from './chart.js';
import { el, tierLabel } from './run_panel.js';

const HEIGHT = 160; // px
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
  const used = typeof info?.used_bytes === 'number' ? info.used_bytes : null;
  const capacity = typeof info?.capacity_bytes === 'number' ? info.capacity_bytes : null;
  const row = el('div', 'mh-oom-tier');
  row.dataset.tier = tier;
  if (used !== null) row.dataset.usedBytes = String(used);
  if (capacity !== null) row.dataset.capacityBytes = String(capacity);
  if (tier === failedTier) row.classList.add('mh-oom-failed-tier');
  const track = el('span', 'mh-bar-track mh-oom-track');
  const fill = el('span', 'mh-bar mh-oom-fill');
  const share = used !== null && capacity ? used / capacity : null;
  fill.style.width = `${share === null ? 0 : Math.min(100, 100 * share)}%`;
  track.append(fill);
  const text =
    capacity === null
      ? `${formatBytes(used)} used (capacity unbounded)`
      : `${formatBytes(used)} of ${formatBytes(capacity)} (${formatPercent(share)})`;
  row.append(el('span', 'mh-oom-tier-name', tierLabel(tier, runInfo)), track, el('span', 'mh-oom-tier-text', text));
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
    this.chart = null;
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
      this.chart = null;
      return;
    }
    this.section.hidden = false;
    this.section.dataset.step = String(answer.step);
    const fr = pm.failed_request ?? {};
    const headline = el(
      'p',
      'mh-oom-headline',
      `Out of memory at step ${pm.step ?? answer.step}: ` +
        `${formatBytes(typeof fr.bytes === 'number' ? fr.bytes : null)} requested on ` +
        `${tierLabel(String(fr.tier ?? '?'), runInfo)}.`,
    );
    const summary = el('p', 'mh-oom-summary', String(pm.summary ?? ''));

    const request = el('div', 'mh-oom-request');
    if (typeof fr.bytes === 'number') request.dataset.bytes = String(fr.bytes);
    request.dataset.tier = String(fr.tier ?? '');
    request.append(
      el('h4', 'mh-subtitle', 'Failed request'),
      facts([
        ['bytes', typeof fr.bytes === 'number' ? `${formatBytes(fr.bytes)} (${fr.bytes} bytes)` : 'unknown'],
        ['tier', fr.tier],
        ['tensor', fr.tensor],
        ['op', fr.op],
        ['error', fr.error_type],
        ['message', fr.message],
      ]),
    );

    const tiersBox = el('div', 'mh-oom-tiers');
    tiersBox.append(el('h4', 'mh-subtitle', 'Tiers at the moment of failure'));
    for (const tier of TIERS) {
      if (pm.tiers?.[tier]) tiersBox.append(tierBar(tier, pm.tiers[tier], runInfo, fr.tier));
    }

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
    recentBox.append(el('h4', 'mh-subtitle', 'Occupancy over the last steps'));
    const plotBox = el('div', 'mh-plot');
    recentBox.append(plotBox);
    const recent = oomRecentSeries(pm);

    const adviceBox = el('div', 'mh-oom-advice-box');
    adviceBox.append(el('h4', 'mh-subtitle', 'What would have made it fit (best first)'));
    const list = el('ol', 'mh-oom-advice');
    for (const a of rankedAdvice(pm)) {
      const li = el('li', 'mh-oom-advice-item');
      li.dataset.rank = String(a?.rank ?? '');
      li.dataset.fits = String(a?.fits === true);
      // `verdict` ("fits" / "may fit" / "does not fit", replayed on the recorded figures);
      // reports without it (older runs) have only the `fits` flag.
      const known = ['fits', 'may fit', 'does not fit'];
      const flag = a?.fits === true ? 'fits' : 'does not fit';
      let verdict = known.includes(a?.verdict) ? a.verdict : flag;
      li.dataset.verdict = verdict;
      if (verdict !== 'fits' && typeof a?.missing_bytes === 'number' && a.missing_bytes > 0) {
        verdict += ` (${formatBytes(a.missing_bytes)} short)`;
      }
      li.append(
        el('span', 'mh-oom-advice-desc', String(a?.description ?? '')),
        el('span', 'mh-oom-advice-change', changeText(a?.change)),
        el(
          'span',
          'mh-oom-advice-meta',
          `frees ${formatBytes(typeof a?.frees_bytes === 'number' ? a.frees_bytes : null)} · ` +
            `${verdict} · speed cost ${a?.speed_cost ?? 'unknown'}`,
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

    this.chart = null;
    if (recent.steps.length) {
      this.chart = new Chart(plotBox, { height: HEIGHT, widthKey: 'oom' });
      const series = [];
      for (const [tier, s] of Object.entries(recent.tiers)) {
        const label = tierLabel(tier, runInfo);
        series.push({ label: `${label} used`, values: s.used, stroke: TIER_COLORS[tier], width: 2 });
        if (s.capacity.some((v) => v !== null)) {
          series.push({ label: `${label} capacity`, values: s.capacity, stroke: TIER_COLORS[tier], dash: [4, 4] });
        }
      }
      plotBox.dataset.points = String(recent.steps.length);
      this.chart.update({ x: recent.steps, series, scales: { y: { unit: 'bytes' } }, markers: [] });
    } else {
      plotBox.append(el('p', 'mh-note', 'No recent steps recorded.'));
    }
  }

  resize() {
    this.chart?.resize();
  }
}
