// The browser's side of a passkey ceremony (WebAuthn Level 3), for the forms that
// templates/_passkey_form.html renders: data-passkey says "get" (sign in) or "create" (add a
// passkey), data-options holds the server's options as JSON (base64url for binary values,
// WebAuthn §5.1.9, §5.1.10). On submit the browser's dialog runs; its credential is put in
// the form as JSON (§5.1.8 RegistrationResponseJSON / AuthenticationResponseJSON) and the
// form is posted as any other. Without this script, or a browser without WebAuthn, the
// forms stay hidden and the page works as before.
(function () {
  "use strict";
  if (!window.PublicKeyCredential || !navigator.credentials) {
    return;
  }

  function fromBase64url(text) {
    const base64 = text.replace(/-/g, "+").replace(/_/g, "/");
    const padded = base64 + "===".slice((base64.length + 3) % 4);
    const binary = atob(padded);
    const bytes = new Uint8Array(binary.length);
    for (let i = 0; i < binary.length; i++) {
      bytes[i] = binary.charCodeAt(i);
    }
    return bytes.buffer;
  }

  function toBase64url(buffer) {
    const bytes = new Uint8Array(buffer);
    let binary = "";
    for (let i = 0; i < bytes.length; i++) {
      binary += String.fromCharCode(bytes[i]);
    }
    return btoa(binary).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
  }

  function descriptors(list) {
    return (list || []).map(function (d) {
      return Object.assign({}, d, { id: fromBase64url(d.id) });
    });
  }

  function creationOptions(o) {
    return Object.assign({}, o, {
      challenge: fromBase64url(o.challenge),
      user: Object.assign({}, o.user, { id: fromBase64url(o.user.id) }),
      excludeCredentials: descriptors(o.excludeCredentials),
    });
  }

  function requestOptions(o) {
    return Object.assign({}, o, {
      challenge: fromBase64url(o.challenge),
      allowCredentials: descriptors(o.allowCredentials),
    });
  }

  function asJSON(credential) {
    const r = credential.response;
    const response = { clientDataJSON: toBase64url(r.clientDataJSON) };
    if (r.attestationObject) {
      response.attestationObject = toBase64url(r.attestationObject);
      response.transports = r.getTransports ? r.getTransports() : [];
    } else {
      response.authenticatorData = toBase64url(r.authenticatorData);
      response.signature = toBase64url(r.signature);
      if (r.userHandle) {
        response.userHandle = toBase64url(r.userHandle);
      }
    }
    return {
      id: credential.id,
      rawId: toBase64url(credential.rawId),
      type: credential.type,
      authenticatorAttachment: credential.authenticatorAttachment || undefined,
      clientExtensionResults: credential.getClientExtensionResults(),
      response: response,
    };
  }

  function enable(form) {
    const problem = form.querySelector(".passkey-error");
    form.hidden = false;
    form.addEventListener("submit", async function (event) {
      event.preventDefault();
      if (!form.reportValidity()) {
        return;
      }
      problem.hidden = true;
      const options = JSON.parse(form.dataset.options);
      let credential;
      try {
        credential =
          form.dataset.passkey === "create"
            ? await navigator.credentials.create({ publicKey: creationOptions(options) })
            : await navigator.credentials.get({ publicKey: requestOptions(options) });
      } catch (error) {
        problem.textContent = "The passkey was not used: " + (error && error.message ? error.message : error);
        problem.hidden = false;
        return;
      }
      if (!credential) {
        return;
      }
      form.elements.passkey_response.value = JSON.stringify(asJSON(credential));
      HTMLFormElement.prototype.submit.call(form);
    });
  }

  function start() {
    document.querySelectorAll("form[data-passkey]").forEach(function (form) {
      if (!form.dataset.enabled) {
        form.dataset.enabled = "1";
        enable(form);
      }
    });
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
