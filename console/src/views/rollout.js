// Rollout: per model its versions, weights and figures, the canary guard's state and last decision;
// new weights go to POST /admin/rollout after a confirmation.
import { useState } from 'preact/hooks';
import { html } from '../html.js';
import { Gate } from '../gate.js';
import { usePoll } from '../poll.js';
import { Confirm } from '../confirm.js';
import { ms, pct, when } from '../format.js';

export function Rollout({ api }) {
  const [res, reload] = usePoll(api, '/admin/rollout', 3000);
  return html`<section><h2>Rollout</h2>
    <${Gate} res=${res} what="Rollout">
      ${(d) => Object.entries(d.models).map(([name, m]) => html`
        <${ModelCard} api=${api} name=${name} m=${m} reload=${reload} />`)}
    <//></section>`;
}

const weightOf = (v) => (typeof v === 'number' ? v : v.weight);

function ModelCard({ api, name, m, reload }) {
  const [draft, setDraft] = useState({});
  const [asking, setAsking] = useState(false);
  const [result, setResult] = useState(null);
  const versions = Object.entries(m.versions);
  const total = versions.reduce((a, [, v]) => a + weightOf(v), 0);
  const changed = Object.entries(draft).filter(([v, w]) => w !== '' && Number(w) !== weightOf(m.versions[v]));
  const apply = async () => {
    setAsking(false);
    try {
      await api.post('/admin/rollout', { model: name, weights: Object.fromEntries(changed.map(([v, w]) => [v, Number(w)])) });
      setResult({ ok: true, text: `Weights of ${name} changed: ${changed.map(([v, w]) => `${v}=${w}`).join(', ')}` });
      setDraft({});
      reload();
    } catch (e) {
      setResult({ ok: false, text: `Refused (${e.status}): ${e.message}` });
    }
  };
  return html`<div class="card" data-model=${name}>
    <h3>${name}</h3>
    <${Guard} guard=${m.guard} />
    <div class="scroll"><table>
      <thead><tr><th>Version</th><th>Weight</th><th>Share</th><th>Requests</th><th>Errors</th>
        <th>TTFT p50</th><th>TTFT p95</th><th>e2e p95</th><th>Note</th></tr></thead>
      <tbody>${versions.map(([v, info]) => html`<tr data-version=${v}>
        <td><b>${v}</b>${info.baseline ? html` <span class="chip">baseline</span>` : ''}</td>
        <td><input type="number" min="0" step="any" class="weight" name=${`weight-${v}`}
          value=${draft[v] ?? weightOf(info)} onInput=${(e) => setDraft({ ...draft, [v]: e.currentTarget.value })} /></td>
        <td>${total ? pct(weightOf(info) / total) : '–'}</td>
        <td>${info.requests ?? '–'}</td><td>${info.errors ?? '–'} (${pct(info.error_rate)})</td>
        <td>${ms(info.ttft_p50)}</td><td>${ms(info.ttft_p95)}</td><td>${ms(info.e2e_p95)}</td>
        <td class="small">${info.rolled_back ? `rolled back: ${info.rolled_back}` : ''}</td></tr>`)}
      </tbody></table></div>
    <div class="toolbar">
      <button type="button" disabled=${!changed.length} data-action="apply-weights"
        onClick=${() => setAsking(true)}>Apply new weights…</button>
      ${changed.length ? html`<button type="button" class="quiet" onClick=${() => setDraft({})}>Undo</button>` : ''}
      ${result ? html`<span class=${result.ok ? 'ok' : 'bad'} data-result>${result.text}</span>` : ''}
    </div>
    ${asking ? html`<${Confirm} title=${`Change the traffic split of ${name}?`} action="Change weights"
      body=${html`<p>${changed.map(([v, w]) => html`<div>${v}: ${weightOf(m.versions[v])} → <b>${w}</b></div>`)}</p>
        <p class="small">Live traffic follows the new weights at once.</p>`}
      onYes=${apply} onNo=${() => setAsking(false)} />` : ''}
  </div>`;
}

function Guard({ guard }) {
  if (!guard) return html`<p class="small muted">Canary guard state: not reported by this router.</p>`;
  const d = guard.last_decision;
  return html`<p class="small">Canary guard: <b data-guard-state>${guard.state}</b>.
    ${d ? html` Last decision: <b>${d.action}</b> (${d.reason}) at ${when(d.at)}.` : ' No decision yet.'}</p>`;
}
