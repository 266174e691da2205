// View: the list of a run's config events (memory_hierarchy/config_event), each with its
// step; the ones that changed something (applied) are drawn as markers on every chart,
// rejected and ignored live-tuning requests are listed with their reason. An applied
// request that was predicted at apply (what-if) shows predicted beside measured.

import { markerWhatifText } from '../whatif.js';
import { el } from './run_panel.js';

/**
 * @param {HTMLUListElement} list
 * @param {Array<{step: number, label: string, status?: string|null, version?: number}>} events
 * @param {object[]} [predictions] GET /tuning's `predictions`: an applied user request
 *   predicted at apply shows predicted beside measured
 */
export function renderConfigList(list, events, predictions = []) {
  const byVersion = new Map(predictions.map((p) => [p.version, p]));
  list.replaceChildren();
  if (!events.length) {
    list.append(el('li', 'mh-note', 'No config changes recorded.'));
    return;
  }
  for (const m of events) {
    const li = el('li', 'mh-config-event');
    li.dataset.step = String(m.step);
    if (m.status) li.dataset.status = m.status;
    if (m.status === 'rejected' || m.status === 'ignored') li.classList.add('mh-config-refused');
    li.append(el('span', 'mh-config-step', `step ${m.step}`), el('span', 'mh-config-label', m.label));
    const p = m.status === 'applied' && m.source !== 'auto' ? byVersion.get(m.version) : null;
    if (p) {
      const span = el('span', 'mh-config-whatif', markerWhatifText(p));
      span.dataset.version = String(p.version);
      li.append(span);
    }
    list.append(li);
  }
}
