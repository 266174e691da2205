// View: the list of a run's config changes (memory_hierarchy/config_event), each with its
// step; the same changes are drawn as markers on every chart.

import { el } from './run_panel.js';

/**
 * @param {HTMLUListElement} list
 * @param {Array<{step: number, label: string}>} markers
 */
export function renderConfigList(list, markers) {
  list.replaceChildren();
  if (!markers.length) {
    list.append(el('li', 'mh-note', 'No config changes recorded.'));
    return;
  }
  for (const m of markers) {
    const li = el('li', 'mh-config-event');
    li.dataset.step = String(m.step);
    li.append(el('span', 'mh-config-step', `step ${m.step}`), el('span', 'mh-config-label', m.label));
    list.append(li);
  }
}
