// The API key field. The key is kept in sessionStorage and sent only as `Authorization: Bearer`.
import { useState } from 'preact/hooks';
import { html } from './html.js';

export function KeyBox({ value, onSave }) {
  const [draft, setDraft] = useState('');
  const submit = (e) => {
    e.preventDefault();
    onSave(draft.trim());
    setDraft('');
  };
  if (value) {
    return html`<div class="keybox">
      <span class="keyset" title="sent as the Authorization header">API key set</span>
      <button type="button" class="quiet" onClick=${() => onSave('')}>Forget key</button></div>`;
  }
  return html`<form class="keybox" onSubmit=${submit}>
    <input type="password" name="api-key" placeholder="API key" autocomplete="off" value=${draft}
           onInput=${(e) => setDraft(e.currentTarget.value)} />
    <button type="submit">Use key</button></form>`;
}
