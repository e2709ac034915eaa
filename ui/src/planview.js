// The Plan screen: the plan's sentence, each decision as "label: brief" with its reason
// folded away, predicted beside measured, Apply, Measure again, and progress meanwhile.

import { h, byId, fill } from './dom.js';
import { groupDecisions, decisionLine, speedRows, measuredNote, originNote } from './planmodel.js';

export class PlanView {
  constructor({ api }) {
    this.api = api;
    this.root = byId('view-plan');
    this.plan = null;
    this.busy = false;
    this.build();
  }

  build() {
    this.sentence = h('h2', { id: 'plan-sentence', class: 'plan-sentence', text: 'No plan yet' });
    this.machine = h('p', { id: 'plan-machine', class: 'plan-machine' });
    this.origin = h('p', { class: 'note', id: 'plan-origin', hidden: true });
    this.warning = h('div', { id: 'plan-warning', class: 'banner banner-warn', role: 'alert', hidden: true });
    this.error = h('div', { id: 'plan-error', class: 'banner banner-error', role: 'alert', hidden: true });
    this.progressLabel = h('span', { id: 'plan-progress-label', class: 'plan-progress-label' });
    this.progressBar = h('progress', { id: 'plan-progress-bar', max: 1, value: 0 });
    this.progress = h('div', { id: 'plan-progress', class: 'plan-progress', hidden: true }, this.progressBar, this.progressLabel);
    this.speed = h('table', { id: 'plan-speed', class: 'plan-speed' });
    this.speedNote = h('p', { class: 'note', id: 'plan-speed-note' });
    this.decisions = h('div', { id: 'plan-decisions', class: 'plan-decisions' });
    this.applyButton = h('button', { type: 'button', id: 'plan-apply', class: 'primary', disabled: true, on: { click: () => this.apply() } }, 'Apply');
    this.measureButton = h('button', { type: 'button', id: 'plan-measure', on: { click: () => this.measure() } }, 'Measure again');
    this.applied = h('span', { id: 'plan-applied', class: 'plan-applied', role: 'status' });
    this.root.append(
      this.sentence, this.machine, this.origin, this.warning, this.error, this.progress,
      h('div', { class: 'plan-bar' }, this.applyButton, this.measureButton, this.applied),
      h('h3', { class: 'panel-sub', text: 'Speed' }), this.speed, this.speedNote,
      this.decisions,
    );
  }

  /** The screen opened: show the plan the server holds, without measuring. */
  async open() {
    if (this.plan || this.busy) return;
    try {
      this.render(await this.api.get('/api/plan?cached=1'));
    } catch (e) {
      this.showError(e.message);
    }
  }

  async measure() {
    this.setBusy(true);
    this.showError('');
    try {
      this.render(await this.api.get('/api/plan?measure=1'));
    } catch (e) {
      this.showError(e.message);
    } finally {
      this.setBusy(false);
    }
  }

  async apply() {
    this.applyButton.disabled = true;
    try {
      await this.api.json('POST', '/api/plan/apply', {});
      this.applied.textContent = 'Applied: the next load uses these settings.';
    } catch (e) {
      this.showError(e.message);
    } finally {
      this.applyButton.disabled = !this.canApply();
    }
  }

  canApply() {
    return Boolean(this.plan && this.plan.decisions && this.plan.regime !== 'will_not_fit') && !this.busy;
  }

  setBusy(busy) {
    this.busy = busy;
    this.measureButton.disabled = busy;
    this.applyButton.disabled = !this.canApply();
  }

  /** A plan_progress event: the stage's words, or done. */
  progressEvent(ev) {
    if (!ev || ev.step === 'done') {
      this.progress.hidden = true;
      return;
    }
    this.progress.hidden = false;
    this.progressBar.max = ev.count || 1;
    this.progressBar.value = ev.index || 0;
    this.progressLabel.textContent = ev.label || '';
  }

  showError(message) {
    this.error.hidden = !message;
    this.error.textContent = message || '';
  }

  render(plan) {
    this.applied.textContent = '';
    if (!plan || plan.none) {
      this.plan = null;
      this.sentence.textContent = 'No plan yet';
      this.machine.textContent = 'Measure to see what this machine can do with the selected model.';
      fill(this.decisions);
      fill(this.speed);
      this.speedNote.textContent = '';
      this.setBusy(this.busy);
      return;
    }
    if (plan.error) {
      this.plan = null;
      this.showError(plan.error);
      this.setBusy(this.busy);
      return;
    }
    this.plan = plan;
    this.showError('');
    this.sentence.textContent = (plan.summary && plan.summary.sentence) || '';
    this.sentence.dataset.regime = plan.regime || '';
    this.machine.textContent = plan.machine || '';
    this.origin.textContent = originNote(plan);
    this.origin.hidden = !this.origin.textContent;
    this.warning.hidden = !plan.warning;
    this.warning.textContent = plan.warning || '';
    this.renderSpeed(plan);
    this.renderDecisions(plan.decisions || []);
    this.setBusy(this.busy);
  }

  renderSpeed(plan) {
    const head = h('tr', {}, h('th', { text: '' }), h('th', { text: 'Predicted' }), h('th', { text: 'Measured' }));
    const rows = speedRows(plan).map((r) => h('tr', { dataset: { row: r.key } },
      h('th', { scope: 'row', text: r.label }), h('td', { class: 'predicted', text: r.predicted }), h('td', { class: 'measured', text: r.measured })));
    fill(this.speed, h('thead', {}, head), h('tbody', {}, rows));
    this.speedNote.textContent = measuredNote(plan);
  }

  renderDecisions(decisions) {
    const groups = groupDecisions(decisions).map((g) => h('section', { class: 'plan-group', dataset: { group: g.key } },
      h('h3', { class: 'panel-sub', text: g.title }),
      h('ul', { class: 'plan-list' }, g.rows.map((d) => h('li', { class: 'plan-decision', dataset: { knob: d.knob, source: d.source } },
        h('details', {},
          h('summary', {}, h('span', { class: 'plan-line', text: decisionLine(d) }), h('span', { class: 'plan-source', text: d.source })),
          h('p', { class: 'plan-reason', text: d.reason || d.brief })))))));
    fill(this.decisions, groups);
  }
}
