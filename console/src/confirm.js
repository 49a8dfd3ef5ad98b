// A confirmation dialog (the native <dialog>): the question, what will change, Cancel / the action.
import { useEffect, useRef } from 'preact/hooks';
import { html } from './html.js';

export function Confirm({ title, body, action, onYes, onNo }) {
  const ref = useRef(null);
  useEffect(() => {
    ref.current.showModal();
  }, []);
  return html`<dialog ref=${ref} class="confirm" onCancel=${onNo}>
    <h3>${title}</h3><div>${body}</div>
    <div class="buttons"><button type="button" class="quiet" onClick=${onNo}>Cancel</button>
      <button type="button" class="danger" data-confirm="yes" onClick=${onYes}>${action}</button></div>
  </dialog>`;
}
