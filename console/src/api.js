// Every call to the server goes through here: the API key travels only in the Authorization header
// (never in a URL), and every mutation is a JSON body (the server refuses form posts).
export class ApiError extends Error {
  constructor(status, message, path) {
    super(message);
    this.status = status;
    this.path = path;
  }
}

export function makeClient(key) {
  const headers = (extra = {}) => (key ? { ...extra, Authorization: `Bearer ${key}` } : extra);

  async function request(method, path, { json, form, signal, headers: extra = {} } = {}) {
    const init = { method, headers: headers(extra), signal, credentials: 'omit', cache: 'no-store' };
    if (json !== undefined) {
      init.headers = headers({ ...extra, 'Content-Type': 'application/json' });
      init.body = JSON.stringify(json);
    } else if (form !== undefined) {
      init.body = form;            // multipart: OpenAI's /v1/files upload, the one non-JSON body
    }
    const resp = await fetch(path, init);
    if (!resp.ok) {
      throw new ApiError(resp.status, await errorText(resp), `${method} ${path}`);
    }
    return resp;
  }

  return {
    key,
    request,
    get: async (path, opts) => (await request('GET', path, opts)).json(),
    text: async (path, opts) => (await request('GET', path, opts)).text(),
    post: async (path, json) => (await request('POST', path, { json: json ?? {} })).json(),
    del: async (path) => (await request('DELETE', path)).json(),
    upload: async (path, form) => (await request('POST', path, { form })).json(),
  };
}

async function errorText(resp) {
  const body = await resp.text();
  try {
    const err = JSON.parse(body).error;
    if (err && err.message) return err.message;
  } catch {
    /* not JSON: the text itself */
  }
  return body.slice(0, 300) || resp.statusText;
}
