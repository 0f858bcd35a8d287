// Ferry console: the only script (no inline scripts; the CSP forbids them).
// Actions ask for confirmation before they are sent.
document.addEventListener("submit", function (event) {
  var form = event.target;
  if (!form.action || form.action.indexOf("/actions/") < 0) return;
  var button = form.querySelector("button");
  var what = button ? button.textContent.trim() : "this action";
  if (!window.confirm(what + "? It is recorded in the audit trail.")) event.preventDefault();
});
